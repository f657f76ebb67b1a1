"""`TrajectoryBatch`: the rows of a rollout as the trainer needs them, from an agent-loop `DataBatch` or from engine
`DiffusionOutput`s. Everything a recompute needs travels with the rows (latents, sigmas, noise level, SDE type,
sigma_max, guidance, conditioning, the engine's execution mode): nothing is looked up from a timestep or mirrored from
a config. Also the columns a rollout batch must carry (`batch_columns`, `conditioning_columns`) and the rows' one
execution mode (`one_execution`), which `CleanBatch` shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from omniroll.models.base import is_conditioning
from omniroll.train.rows import rows_to, take_rows


#: trajectory tensors every row must carry (DataBatch key -> TrajectoryBatch field)
_REQUIRED = {"all_latents": "latents", "all_timesteps": "timesteps", "sigmas": "sigmas", "sigmas_next": "sigmas_next",
             "noise_level": "noise_level", "sigma_max": "sigma_max", "guidance_scale": "guidance_scale",
             "cfg_scale": "cfg_scale"}


def batch_columns(batch: Any, tensors: list[str], non_tensors: list[str], hint: str) -> tuple[Any, dict]:
    """(batch.batch, batch.non_tensor_batch) of a rollout batch with every named column and no failed row; ValueError
    naming what is missing (`hint`: how such a batch is made) otherwise."""
    td, nt = batch.batch, batch.non_tensor_batch
    keys = set(td.keys())
    missing = [k for k in tensors if k not in keys]
    if missing:
        raise ValueError(f"batch lacks field(s) {missing} ({hint}); has {sorted(keys)}")
    for k in non_tensors:
        if k not in nt:
            raise ValueError(f"batch lacks non_tensor_batch[{k!r}]")
    if "status" in nt and any(s == "failed" for s in nt["status"]):
        raise ValueError("batch has failed rows (status 'failed'); drop them before training")
    return td, nt


def conditioning_columns(td: Any) -> tuple[dict, dict, dict]:
    """(cond, uncond, lengths): a batch's conditioning tensors (`*prompt_embeds`), their negative prompts' where the
    rows use CFG, and the real-token count of every padded one (from its `*_mask`)."""
    keys = set(td.keys())
    cond, uncond, lengths = {}, {}, {}
    for k in sorted(keys):
        if is_conditioning(k):
            cond[k] = td[k]
            if f"{k}_mask" in keys:
                lengths[k] = td[f"{k}_mask"].sum(1)
            neg = f"negative_{k}"
            if neg in keys:
                uncond[k] = td[neg]
                if f"{neg}_mask" in keys:
                    lengths[neg] = td[f"{neg}_mask"].sum(1)
    if not cond:
        raise ValueError(f"batch carries no conditioning (*prompt_embeds) tensors; has {sorted(keys)}")
    return cond, uncond, lengths


@dataclass
class TrajectoryBatch:
    """B rows. latents [B, W+1, ...] fp32 (the state before each window step, then after the last); timesteps, sigmas,
    sigmas_next, log_probs [B, W]; noise_level, sigma_max, guidance_scale [B] (fp32; a distilled-guidance model's
    input); cfg_scale [B] (fp64, the CFG mix's scale, 0: no unconditional row); experts [B, W] (the denoiser of each
    step, multi-expert families only); sde_type: B names; cond / uncond:
    conditioning tensors [B, ...] with `lengths` [B] of real tokens for the padded sequence ones (uncond None when no
    row uses CFG); weight_version: B ints; execution: the engine's mode (`batch_invariant`, `invariant_block_rows`,
    `dtype`), the same for every row; step_indices [B, W] long: the denoising step index of each window step (None:
    the batch does not record it; window step k then counts as step k): the ratio statistics per timestep key by it,
    and a tree-trained algorithm finds a step's node by it."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    log_probs: torch.Tensor
    noise_level: torch.Tensor
    sigma_max: torch.Tensor
    guidance_scale: torch.Tensor
    cfg_scale: torch.Tensor
    sde_type: list[str]
    cond: dict[str, torch.Tensor]
    uncond: Optional[dict[str, torch.Tensor]]
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: Optional[torch.Tensor] = None
    weight_version: list[int] = field(default_factory=list)
    execution: dict = field(default_factory=dict)
    step_indices: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        """W: recorded window steps per row."""
        return int(self.log_probs.shape[1])

    def rows(self, idx: Sequence[int] | torch.Tensor) -> "TrajectoryBatch":
        """A sub-batch (row order as given)."""
        return take_rows(self, idx)

    def denoising_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """[B] long (CPU): the denoising step index of each row's window step `steps[i]` (the step itself when the batch
        does not record `step_indices`)."""
        steps = torch.as_tensor(steps, dtype=torch.long).reshape(-1).cpu()
        if self.step_indices is None:
            return steps
        return self.step_indices.cpu().long()[torch.arange(len(self)), steps]

    def to(self, device: str | torch.device) -> "TrajectoryBatch":
        """The rows on `device` (`rows_to`)."""
        return rows_to(self, device)

    def at_steps(self, steps: torch.Tensor) -> "TrajectoryBatch":
        """The same rows with one window step each (W = 1): row i's step `steps[i]` (DanceGRPO trains a different
        random step per row in one forward)."""
        steps = torch.as_tensor(steps, dtype=torch.long).reshape(-1)
        i = torch.arange(len(self))
        pair = torch.stack([steps, steps + 1], 1)
        return replace(self, latents=self.latents[i[:, None], pair], timesteps=self.timesteps[i, steps][:, None],
                       sigmas=self.sigmas[i, steps][:, None], sigmas_next=self.sigmas_next[i, steps][:, None],
                       log_probs=self.log_probs[i, steps][:, None],
                       experts=self.experts[i, steps][:, None] if self.experts is not None else None,
                       step_indices=self.denoising_steps(steps)[:, None] if self.step_indices is not None else None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_batch(cls, batch: Any) -> "TrajectoryBatch":
        """From the agent loop's output `DataBatch` (or anything with `.batch` / `.non_tensor_batch`, e.g. verl's
        DataProto). Failed rows must be removed first."""
        td, nt = batch_columns(batch, list(_REQUIRED) + ["rollout_log_probs"],
                               ["sde_type", "execution", "weight_version"],
                               "was it generated with logprobs and an SDE window?")
        vals = {f: td[k] for k, f in _REQUIRED.items()}
        cond, uncond, lengths = conditioning_columns(td)
        return cls(log_probs=td["rollout_log_probs"].float(), sde_type=[str(s) for s in nt["sde_type"]],
                   cond=cond, uncond=uncond or None, lengths=lengths,
                   experts=td["expert_indices"] if "expert_indices" in td.keys() else None,
                   weight_version=[int(v) for v in nt["weight_version"]],
                   execution=one_execution(list(nt["execution"])),
                   step_indices=td["step_indices"].long() if "step_indices" in td.keys() else None, **vals)

    @classmethod
    def from_outputs(cls, outputs: Sequence[Any]) -> "TrajectoryBatch":
        """From engine / client `DiffusionOutput`s (completed, with log-probs; one window size and prompt length)."""
        if not outputs:
            raise ValueError("from_outputs needs at least one output")
        bad = [o.request_id for o in outputs if o.stop_reason != "completed" or o.log_probs is None]
        if bad:
            raise ValueError(f"outputs {bad[:8]} are not completed samples with log-probs")
        efs = [o.extra_fields for o in outputs]

        def stack(k):
            return torch.stack([torch.as_tensor(e[k]) for e in efs])

        cond_keys = sorted(k for k in efs[0] if is_conditioning(k) and isinstance(efs[0][k], torch.Tensor))
        cond = {k: stack(k) for k in cond_keys}
        cfg = [all(f"negative_{k}" in e for k in cond_keys) for e in efs]
        uncond = None
        if any(cfg):
            if not all(cfg):
                raise ValueError("outputs mix CFG and non-CFG rows; build one TrajectoryBatch per kind")
            uncond = {k: stack(f"negative_{k}") for k in cond_keys}
        return cls(latents=stack("all_latents"), timesteps=stack("all_timesteps"), sigmas=stack("sigmas"),
                   sigmas_next=stack("sigmas_next"), log_probs=torch.stack([o.log_probs.float() for o in outputs]),
                   noise_level=torch.tensor([float(e["noise_level"]) for e in efs]),
                   sigma_max=torch.tensor([float(e["sigma_max"]) for e in efs]),
                   guidance_scale=torch.tensor([float(e["guidance_scale"]) for e in efs]),
                   cfg_scale=torch.tensor([float(e["cfg_scale"]) for e in efs], dtype=torch.float64),
                   experts=stack("expert_indices") if "expert_indices" in efs[0] else None,
                   sde_type=[str(e["sde_type"]) for e in efs], cond=cond, uncond=uncond,
                   weight_version=[int(e.get("weight_version", 0)) for e in efs],
                   execution=one_execution([e.get("execution") for e in efs]),
                   step_indices=stack("step_indices").long() if all("step_indices" in e for e in efs) else None)


def one_execution(values: list) -> dict:
    """The rows' common execution mode (they must agree: one trainer recompute mode per batch)."""
    modes = {tuple(sorted(dict(v).items())) if isinstance(v, dict) else None for v in values}
    if None in modes:
        raise ValueError("some rows carry no 'execution' record (batch_invariant, invariant_block_rows, dtype): "
                         "they come from an engine that does not record it")
    if len(modes) != 1:
        raise ValueError(f"rows were generated under different execution modes {sorted(modes)}; replicas of one "
                         f"rollout must share batch_invariant, invariant_block_rows and dtype")
    return dict(next(iter(modes)))
