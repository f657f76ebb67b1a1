"""One row's agent loop, and what comes out of it.

- The registry of loops: `@register("name")` on a loop class, `get_agent_loop_class(name)` to look one up (a row's
  `agent_name`, else `agent.default_agent_loop`).
- `DiffusionSingleTurnAgentLoop`, the built-in loop: one prompt in, one generated image (plus its trajectory) out.
- What a loop returns: the specification's `DiffusionAgentLoopOutput` and `AgentLoopMetrics`.
- How the worker stacks its rows' outputs into one `DataBatch` (`assemble`, the worker's output contract), below.

Output contract of `assemble`. Tensors ([B, ...]): `prompts` / `attention_mask` (int64 [B, prompt_length], token ids
right-padded with 0; mask 1 on real tokens), `responses` (uint8 [B, 3, H, W]; video [B, T, 3, H, W]),
`rollout_log_probs` (fp32 [B, W], when requested), every tensor extra of the DiffusionOutput stacked as is
(`all_latents` [B, W+1, C, h, w] or video [B, W+1, C, t, h, w], `all_timesteps`, `sigmas`, `sigmas_next`,
`step_indices`, `pooled_prompt_embeds`, ...), `*prompt_embeds` zero-padded on the right to Lmax with a `*_mask`
([B, Lmax] int64, 1 = real token), per-row scalars `noise_level`, `sigma_max`, `guidance_scale` (fp32 [B]), `cfg_scale`
(fp64 [B], 0: no CFG) and `sde_window` (int64 [B, 2]); `rm_scores` (fp32 [B, 1]) only when every row was scored;
`failed` (bool [B]) in mark mode.
Weight versions (non-tensor, per row; None for a failed row; see omniroll/engine/request.py): `weight_version`,
`step_weight_versions` (a list of W ints, the version that ran each recorded step), `min_weight_version` /
`max_weight_version` (ints); `meta_info["min_weight_version"]` / `["max_weight_version"]` span the batch.
Lmax = `max_prompt_embed_length`, else the longest row of this batch (the manager re-pads across chunks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from omniroll.agent_loop.batch import DataBatch
from omniroll.models.base import is_sequence_embedding

# ------------------------------------------------------------------------------------------------------- the registry
_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make an agent-loop class available as `agent_name=name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"agent loop name must be a non-empty string, got {name!r}")

    def deco(cls: type) -> type:
        prev = _REGISTRY.get(name)
        if prev is not None and prev is not cls and prev.__qualname__ != cls.__qualname__:
            raise ValueError(f"agent loop {name!r} is already registered to {prev.__module__}.{prev.__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def get_agent_loop_class(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown agent_name {name!r}; registered agent loops: {registered_names()}") from None


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


# ------------------------------------------------------------------------------------------------ what a loop returns
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


# ----------------------------------------------------------------------------------------------- the single-turn loop
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


@register("diffusion_single_turn_agent")
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


# --------------------------------------------------------------------------------------------------- the batch
SCALAR_TENSORS = {"noise_level": torch.float32, "sigma_max": torch.float32, "guidance_scale": torch.float32,
                  "cfg_scale": torch.float64, "sde_window": torch.int64}
NON_TENSOR_EXTRAS = ("weight_version", "step_weight_versions", "min_weight_version", "max_weight_version", "sde_type",
                     "sampling_params", "stop_reason", "replica_index", "replica_node_id", "rollout_attempts",
                     "execution")
METRIC_EXTRAS = ("generate_seconds", "client_seconds", "generate_finished_at")


@dataclass
class RowResult:
    """What one row's task produced. `out` is None when generation failed; a row whose reward failed keeps its
    output and has `error` set."""

    index: int
    request_id: str
    seed: int
    out: Optional[DiffusionAgentLoopOutput] = None
    error: Optional[str] = None
    reward: Any = None  # omniroll.reward.RewardResult
    score_started_at: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return "flagged" if self.reward is not None and self.reward.status == "flagged" else "ok"


def embed_length_error(out: DiffusionAgentLoopOutput, max_len: Optional[int]) -> Optional[str]:
    """Why this row's prompt embeddings do not fit `max_prompt_embed_length` (None when they do)."""
    if max_len is None:
        return None
    for k, v in out.extra_fields.items():
        if is_sequence_embedding(k) and isinstance(v, torch.Tensor) and v.shape[0] > max_len:
            return (f"{k} has {v.shape[0]} tokens, more than max_prompt_embed_length={max_len} "
                    f"(raise max_prompt_embed_length or lower pipeline.max_sequence_length)")
    return None


def pad_embeds(t: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, D] -> ([length, D] zero-padded on the right, [length] int64 mask)."""
    n = t.shape[0]
    padded = torch.zeros((length,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[:n] = t
    mask = torch.zeros(length, dtype=torch.int64)
    mask[:n] = 1
    return padded, mask


def _stack(name: str, rows: list[RowResult], values: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """Stack per-row tensors; rows without a value (failed) get zeros of the common shape."""
    present = [(r, v) for r, v in zip(rows, values) if v is not None]
    shapes = {tuple(v.shape) for _, v in present}
    if len(shapes) > 1:
        detail = ", ".join(f"row {r.index}: {tuple(v.shape)}" for r, v in present[:8])
        raise ValueError(f"cannot stack field {name!r}: rows have different shapes ({detail}); rows in one batch "
                         f"must share height, width and SDE window size")
    template = present[0][1]
    return torch.stack([v if v is not None else torch.zeros_like(template) for v in values])


def assemble(rows: list[RowResult], inputs: DataBatch, *, prompt_length: int, max_prompt_embed_length: Optional[int],
             mark_failed: bool, scored: bool) -> DataBatch:
    B = len(rows)
    ok = [r.out for r in rows]  # None where generation failed (zeros in mark mode); reward failures keep tensors
    tensors: dict[str, torch.Tensor] = {}

    prompts = torch.zeros(B, prompt_length, dtype=torch.int64)
    attn = torch.zeros(B, prompt_length, dtype=torch.int64)
    for i, o in enumerate(ok):
        if o is not None:
            ids = o.prompt_ids[:prompt_length] if len(o.prompt_ids) <= prompt_length else None
            if ids is None:
                raise ValueError(f"row {rows[i].index}: prompt has {len(o.prompt_ids)} token ids, more than "
                                 f"prompt_length={prompt_length}")
            prompts[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
            attn[i, :len(ids)] = 1
    tensors["prompts"], tensors["attention_mask"] = prompts, attn

    live = [o for o in ok if o is not None]
    if live:
        tensors["responses"] = _stack("responses", rows, [o.response_diffusion_output if o else None for o in ok])
        if any(o.response_logprobs is not None for o in live):
            if any(o.response_logprobs is None for o in live):
                raise ValueError("rollout_log_probs: some rows have log-probs and some do not (mixed 'logprobs')")
            tensors["rollout_log_probs"] = _stack(
                "rollout_log_probs", rows, [o.response_logprobs.float() if o else None for o in ok])
        tensor_keys = sorted({k for o in live for k, v in o.extra_fields.items() if isinstance(v, torch.Tensor)})
        for k in tensor_keys:
            missing = [rows[i].index for i, o in enumerate(ok) if o is not None and k not in o.extra_fields]
            if missing:
                raise ValueError(f"field {k!r} is missing in rows {missing} but present in others (mixed CFG?)")
            vals = [o.extra_fields[k] if o else None for o in ok]
            if is_sequence_embedding(k):
                lmax = max_prompt_embed_length or max(v.shape[0] for v in vals if v is not None)
                pads = [pad_embeds(v, lmax) if v is not None else (None, None) for v in vals]
                tensors[k] = _stack(k, rows, [p for p, _ in pads])
                tensors[f"{k}_mask"] = _stack(f"{k}_mask", rows, [m for _, m in pads])
            else:
                tensors[k] = _stack(k, rows, vals)
        for k, dt in SCALAR_TENSORS.items():
            if all(k in o.extra_fields for o in live):
                vals = [torch.tensor(o.extra_fields[k], dtype=dt) if o else None for o in ok]
                tensors[k] = _stack(k, rows, vals)
    if scored and all(r.reward is not None and r.reward.score is not None for r in rows):
        tensors["rm_scores"] = torch.tensor([[float(r.reward.score)] for r in rows], dtype=torch.float32)
    if mark_failed:
        tensors["failed"] = torch.tensor([r.status == "failed" for r in rows], dtype=torch.bool)

    nt: dict[str, Any] = {k: v for k, v in inputs.non_tensor_batch.items()}
    nt["request_id"] = [r.request_id for r in rows]
    nt["seed"] = [r.seed for r in rows]
    nt["status"] = [r.status for r in rows]
    nt["__num_turns__"] = [o.num_turns if o else 0 for o in ok]
    for k in NON_TENSOR_EXTRAS:
        nt[k] = [o.extra_fields.get(k) if o else None for o in ok]
    if mark_failed:
        nt["error"] = [r.error for r in rows]
    reward_keys: list[str] = []
    if scored:
        infos = [_reward_info(r) for r in rows]
        nt["reward_extra_info"] = infos
        comps = [set(r.reward.components) if r.reward is not None else set() for r in rows]
        reward_keys = sorted(set.intersection(*comps)) if comps else []
        for k in reward_keys:
            if k in nt:
                raise ValueError(f"reward component {k!r} collides with a batch field of the same name")
            nt[k] = [r.reward.components[k] for r in rows]

    metrics = []
    for r, o in zip(rows, ok):
        m = dict(o.metrics.model_dump()) if o else {"generate_sequences": 0.0, "compute_score": 0.0,
                                                      "num_preempted": -1}
        m.update({k: o.extra_fields.get(k) for k in METRIC_EXTRAS} if o else {})
        m["score_started_at"] = r.score_started_at
        m["request_id"] = r.request_id
        metrics.append(m)
    versions = [int(o.extra_fields[k]) for o in live for k in ("weight_version", "min_weight_version",
                                                                  "max_weight_version") if k in o.extra_fields]
    meta = dict(inputs.meta_info)
    meta.update(metrics=metrics, reward_extra_keys=reward_keys,
                min_weight_version=min(versions) if versions else None,
                max_weight_version=max(versions) if versions else None)
    return DataBatch.from_dict(tensors=tensors, non_tensors=nt, meta_info=meta)


def _reward_info(r: RowResult) -> Optional[dict]:
    if r.reward is None:
        return None
    rr = r.reward
    return {"score": rr.score, "status": rr.status, "error": rr.error, "components": dict(rr.components),
            "started_at": rr.started_at, "finished_at": rr.finished_at, **dict(rr.extra_info)}
