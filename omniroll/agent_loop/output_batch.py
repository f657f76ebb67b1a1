"""The agent loop's output batch: how a worker stacks its rows' outputs into one `DataBatch` (`assemble`), and so the
batch's shape contract.

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

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from omniroll.agent_loop.batch import DataBatch
from omniroll.agent_loop.outputs import DiffusionAgentLoopOutput
from omniroll.models.base import is_sequence_embedding

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


def fit_error(out: DiffusionAgentLoopOutput, prompt_length: int,
              max_prompt_embed_length: Optional[int]) -> Optional[str]:
    """Why a row's output does not fit its batch's shapes (None: it fits): more prompt token ids than
    `prompt_length` (a model the config load could not look into), or prompt embeddings longer than
    `max_prompt_embed_length`. Checked once per row, where its `RowResult` is made (the agent-loop worker, where that
    row fails alone; `trajectory_file.batch_from_outputs`); `assemble` relies on it."""
    if len(out.prompt_ids) > prompt_length:
        return (f"the prompt has {len(out.prompt_ids)} token ids (the tokenizer's padded length), more than "
                f"prompt_length={prompt_length}")
    if max_prompt_embed_length is None:
        return None
    for k, v in out.extra_fields.items():
        if is_sequence_embedding(k) and isinstance(v, torch.Tensor) and v.shape[0] > max_prompt_embed_length:
            return (f"{k} has {v.shape[0]} tokens, more than max_prompt_embed_length={max_prompt_embed_length} "
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
    """The rows' outputs as one DataBatch (the module docstring's contract), each row checked by `fit_error` first;
    raises naming the field whose rows do not stack."""
    B = len(rows)
    ok = [r.out for r in rows]  # None where generation failed (zeros in mark mode); reward failures keep tensors
    tensors: dict[str, torch.Tensor] = {}

    # 1. Prompt token ids, right-padded to prompt_length (each row fits: `fit_error`), and their mask.
    prompts = torch.zeros(B, prompt_length, dtype=torch.int64)
    attn = torch.zeros(B, prompt_length, dtype=torch.int64)
    for i, o in enumerate(ok):
        if o is not None:
            prompts[i, :len(o.prompt_ids)] = torch.tensor(o.prompt_ids, dtype=torch.int64)
            attn[i, :len(o.prompt_ids)] = 1
    tensors["prompts"], tensors["attention_mask"] = prompts, attn

    # 2. The samples' tensors: responses, log-probs, every tensor extra (embeddings padded to Lmax), per-row scalars.
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
    # 3. Rewards and the failed mask.
    if scored and all(r.reward is not None and r.reward.score is not None for r in rows):
        tensors["rm_scores"] = torch.tensor([[float(r.reward.score)] for r in rows], dtype=torch.float32)
    if mark_failed:
        tensors["failed"] = torch.tensor([r.status == "failed" for r in rows], dtype=torch.bool)

    # 4. Non-tensor columns: the inputs', ids, seeds, status, weight versions, reward extras.
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

    # 5. meta_info: per-row metrics and the batch's weight-version span.
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
