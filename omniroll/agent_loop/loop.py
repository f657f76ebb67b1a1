"""`DiffusionSingleTurnAgentLoop`, the built-in agent loop: one prompt in, one generated image (plus its trajectory)
out; and `prompt_text`, a row's prompt as plain text."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from omniroll.agent_loop.outputs import DiffusionAgentLoopOutput, agent_loop_output
from omniroll.config.agent_loops import SINGLE_TURN, register


def prompt_text(raw: Any, field: str = "raw_prompt") -> str:
    """A prompt as a plain string: a string as is; chat messages [{"role", "content"}, ...] -> the user text (all user
    messages joined by newlines; list-of-parts content keeps its text parts)."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, np.ndarray):
        raw = raw.tolist()
    if isinstance(raw, (list, tuple)):
        texts = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{field}[{i}] must be a chat message {{'role', 'content'}}, got {m!r}")
            if m["role"] == "user":
                texts.append(_content_text(m["content"], f"{field}[{i}].content"))
        if not texts:
            raise ValueError(f"{field} has no message with role 'user'")
        return "\n".join(texts)
    raise ValueError(f"{field} must be a string or a list of chat messages, got {type(raw).__name__}")


def _content_text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return "".join(parts)
    raise ValueError(f"{field} must be a string or a list of parts, got {type(content).__name__}")


@register(SINGLE_TURN)
class DiffusionSingleTurnAgentLoop:
    """Agent loop for diffusion model serving. Built once per worker (not per sample); `run` is re-entrant."""

    def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any = None, processor: Any = None,
                 dataset_cls: Optional[type] = None, data_config: Any = None, **kwargs):
        self.config = trainer_config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> DiffusionAgentLoopOutput:
        """Run one diffusion generation turn and package agent-loop output.

        kwargs: per-sample fields: `raw_prompt` (required), `raw_negative_prompt`, `request_id`, `seed`, `uid`.
        """
        if kwargs.get("raw_prompt") is None:
            raise ValueError("raw_prompt is missing for this row")
        for f in ("request_id", "seed"):
            if kwargs.get(f) is None:
                raise ValueError(f"{f} is missing for this row")
        prompt = prompt_text(kwargs["raw_prompt"])
        neg = kwargs.get("raw_negative_prompt")
        negative = None if neg is None else prompt_text(neg, "raw_negative_prompt")
        t0 = time.perf_counter()
        out = await self.server_manager.generate(
            request_id=str(kwargs["request_id"]), prompt=prompt, sampling_params=sampling_params,
            seed=int(kwargs["seed"]), negative_prompt=negative, group_id=kwargs.get("uid"),
        )
        return agent_loop_output(out, time.perf_counter() - t0)
