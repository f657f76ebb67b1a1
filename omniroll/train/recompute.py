"""The trainer's recompute: the log-prob of recorded window steps under the current policy, with autograd.

It reproduces the rollout exactly: the same adapter `velocity` (differentiable; the engine calls it under no_grad),
the same CFG mix (`uncond + g * (cond - uncond)`, rows without CFG use `cond`), the same `sde_step` fed with the
trajectory's own sigma, sigma_next, noise level, SDE type and sigma_max, and the engine's execution mode (batch-invariant
kernels with the same block size), read from the trajectory. With the rollout's weights it returns the rollout's
log-probs bitwise, so a PPO ratio is exactly 1 before the first update.

    out = recompute_log_probs(policy_adapter, traj, step=k)   # SDEStepOutput: log_prob [B] (with grad), mean, std
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from omniroll.engine.invariant import BatchInvariantMode
from omniroll.models.base import DiffusionAdapter
from omniroll.sampling import SDEStepOutput, sde_step
from omniroll.train.trajectory import TrajectoryBatch


def execution_mode(execution: dict):
    """The context the engine ran its model calls in (`extra_fields["execution"]` of a trajectory)."""
    if execution.get("batch_invariant"):
        return BatchInvariantMode(int(execution["invariant_block_rows"]))
    return contextlib.nullcontext()


def check_dtype(adapter: DiffusionAdapter, execution: dict) -> None:
    want = execution.get("dtype")
    have = str(adapter.denoiser.dtype).removeprefix("torch.")
    if want is not None and want != have:
        raise ValueError(f"the policy computes in {have} but the rollout ran in {want}: load the trainer's model in "
                         f"{want} for exact ratios (or pass check_dtype=False to accept the mismatch)")


def guided_velocity(adapter: DiffusionAdapter, traj: TrajectoryBatch, latents: torch.Tensor,
                    timesteps: torch.Tensor, step: int = 0) -> torch.Tensor:
    """Velocity after CFG for every row, as the engine's runner computes it: the rows and the unconditional rows of
    CFG rows in one forward per (prompt length, denoiser), distilled guidance as the model's input, then
    `adapter.mix_cfg(cond, uncond, cfg_scale)` per CFG row."""
    B = len(traj)
    expert = [int(traj.experts[i, step]) if traj.experts is not None else 0 for i in range(B)]
    key = [tuple(int(traj.lengths[k][i]) for k in sorted(traj.lengths)) + (expert[i],) for i in range(B)]
    out: list[Optional[torch.Tensor]] = [None] * B
    for group in dict.fromkeys(key):
        rows = [i for i in range(B) if key[i] == group]
        cfg = [i for i in rows if traj.uncond is not None and float(traj.cfg_scale[i]) > 0]
        cond = {k: torch.cat([_trim(traj, k, traj.cond[k], rows)]
                             + ([_trim(traj, f"negative_{k}", traj.uncond[k], cfg)] if cfg else []))
                for k in traj.cond}
        x = torch.cat([latents[rows], latents[cfg]])
        t = torch.cat([timesteps[rows], timesteps[cfg]])
        guidance = traj.guidance_scale[rows + cfg] if adapter.guidance_kind == "distilled" else None
        v_all = adapter.velocity(x, t, cond, guidance=guidance, expert=group[-1]).float()
        pos = {i: j for j, i in enumerate(rows)}
        for j, i in enumerate(rows):
            out[i] = v_all[j]
        for j, i in enumerate(cfg):
            out[i] = adapter.mix_cfg(v_all[pos[i]], v_all[len(rows) + j], float(traj.cfg_scale[i]))
    return torch.stack(out)


def _trim(traj: TrajectoryBatch, name: str, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows' conditioning without padding (all rows of a group share their lengths)."""
    t = t[rows]
    if name in traj.lengths and rows:
        t = t[:, : int(traj.lengths[name][rows[0]])]
    return t


def recompute_log_probs(adapter: DiffusionAdapter, traj: TrajectoryBatch, step: int, *,
                        check_dtype_matches: bool = True) -> SDEStepOutput:
    """Score window step `step` (0 <= step < W) of every row under `adapter`'s current weights.

    Runs with autograd when grad is enabled (the trainer's loss), without it under `torch.no_grad()` (e.g. a KL
    reference with the adapter disabled). Returns `sde_step`'s output: `log_prob` [B], `mean`, `std`.
    """
    W = traj.num_steps
    if not 0 <= step < W:
        raise ValueError(f"step must be in [0, {W}) (the recorded window steps), got {step}")
    if check_dtype_matches:
        check_dtype(adapter, traj.execution)
    x = traj.latents[:, step]
    with execution_mode(traj.execution):
        v = guided_velocity(adapter, traj, x, traj.timesteps[:, step], step)
    return sde_step(x, v, traj.sigmas[:, step], traj.sigmas_next[:, step], traj.noise_level, traj.sde_type,
                    prev_sample=traj.latents[:, step + 1], sigma_max=traj.sigma_max)


def enable_gradient_checkpointing(denoiser: torch.nn.Module, execution: dict) -> None:
    """diffusers' gradient checkpointing, made exact: a non-reentrant checkpoint whose recompute pass enters the
    engine's execution mode too (the forward pass already runs inside it), so forward values and gradients stay
    bitwise those of a run without checkpointing. (diffusers' default recomputes outside the mode, which changes the
    kernels and makes torch raise CheckpointError.) Off unless a trainer asks for it."""
    from torch.utils.checkpoint import checkpoint

    fn = functools.partial(checkpoint, use_reentrant=False,
                           context_fn=lambda: (contextlib.nullcontext(), execution_mode(execution)))
    denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=fn)
