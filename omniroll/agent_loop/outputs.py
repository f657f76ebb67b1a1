"""What an agent loop returns: the specification's `DiffusionAgentLoopOutput` and `AgentLoopMetrics`, and
`agent_loop_output` (a `DiffusionOutput` as a loop's output)."""

from __future__ import annotations

import time
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

class AgentLoopMetrics(BaseModel):
    """Seconds spent generating and scoring one sample; `num_preempted` is -1 when unknown."""

    generate_sequences: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


class DiffusionAgentLoopOutput(BaseModel):
    """Agent loop output.

    prompt_ids: prompt token ids; response_diffusion_output: image tensor (CHW) / video tensor (TCHW);
    response_logprobs: fp32 [W] log-probs of the recorded SDE steps; reward_score: the trajectory's reward;
    num_turns: chat turns including user and assistant (2 for single turn); extra_fields: the DiffusionOutput's
    extra fields (trajectory, embeddings, seed, weight_version, ...) plus `stop_reason`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    response_diffusion_output: Any
    response_logprobs: Optional[Any] = None
    reward_score: Optional[float] = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}


def agent_loop_output(out: Any, generate_seconds: float) -> DiffusionAgentLoopOutput:
    """A DiffusionOutput as the single-turn agent loop's output (also how `omniroll generate` builds its batch)."""
    extra = dict(out.extra_fields)
    extra["stop_reason"] = out.stop_reason
    extra["generate_finished_at"] = time.time()
    return DiffusionAgentLoopOutput(
        prompt_ids=list(extra.pop("prompt_ids", []) or []),
        response_diffusion_output=out.diffusion_output,
        response_logprobs=out.log_probs,
        num_turns=2,
        metrics=AgentLoopMetrics(
            generate_sequences=generate_seconds,
            num_preempted=-1 if out.num_preempted is None else int(out.num_preempted)),
        extra_fields=extra,
    )
