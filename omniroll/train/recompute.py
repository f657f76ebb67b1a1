"""The recompute: the log-prob of recorded window steps under the current policy, with autograd
(`recompute_log_probs`), and the velocity it is built on (`trajectory_velocity`).

It reproduces the rollout exactly because it runs the rollout's own functions: `adapter.guided_velocity` (CFG rows
stacked, `velocity`, the CFG mix; differentiable, the engine calls it under no_grad), `sde_step` fed with the
trajectory's own sigma, sigma_next, noise level, SDE type and sigma_max, inside `engine.execution.execution_mode`
(batch-invariant kernels with the same block size), read from the trajectory. With the rollout's weights it returns
the rollout's log-probs bitwise, so a PPO ratio is exactly 1 before the first update.

    out = recompute_log_probs(policy_adapter, traj, step=k)   # SDEStepOutput: log_prob [B] (with grad), mean, std

`enable_gradient_checkpointing`: diffusers' gradient checkpointing with its recompute pass inside the same execution
mode, so checkpointing changes no value.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from omniroll.engine.execution import execution_mode
from omniroll.models.base import NO_CFG, DiffusionAdapter, denoiser_experts
from omniroll.sampling import SDEStepOutput, sde_step
from omniroll.train.trajectory_batch import TrajectoryBatch


def check_dtype(adapter: DiffusionAdapter, execution: dict) -> None:
    want = execution.get("dtype")
    have = str(adapter.compute_dtype).removeprefix("torch.")
    if want is not None and want != have:
        raise ValueError(f"the policy computes in {have} but the rollout ran in {want}: load the trainer's model in "
                         f"{want} for exact ratios (or pass check_dtype=False to accept the mismatch)")


def trajectory_velocity(adapter: DiffusionAdapter, traj: TrajectoryBatch, latents: torch.Tensor,
                        timesteps: torch.Tensor, step: int = 0) -> torch.Tensor:
    """Velocity after CFG for every row: `adapter.guided_velocity` (the engine's own call) once per (prompt
    lengths, denoiser) group, on the group's conditioning without padding."""
    B = len(traj)
    expert = [int(traj.experts[i, step]) if traj.experts is not None else 0 for i in range(B)]
    key = [tuple(int(traj.lengths[k][i]) for k in sorted(traj.lengths)) + (expert[i],) for i in range(B)]
    out: list[Optional[torch.Tensor]] = [None] * B
    for group in dict.fromkeys(key):
        rows = [i for i in range(B) if key[i] == group]
        scales = [float(traj.cfg_scale[i]) if traj.uncond is not None else NO_CFG for i in rows]
        cfg = [i for i, g in zip(rows, scales) if g != NO_CFG]
        cond = {k: _trim(traj, k, traj.cond[k], rows) for k in traj.cond}
        uncond = {k: _trim(traj, f"negative_{k}", traj.uncond[k], cfg) for k in traj.cond} if cfg else None
        guidance = traj.guidance_scale[rows] if adapter.guidance_kind == "distilled" else None
        v = adapter.guided_velocity(latents[rows], timesteps[rows], cond, uncond, scales, guidance=guidance,
                                    expert=group[-1])
        for j, i in enumerate(rows):
            out[i] = v[j]
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
    if traj.execution.get("merge_lora"):
        raise ValueError("these trajectories were rolled out with engine.merge_lora (a LoRA adapter merged into the "
                         "weights): the recompute, the adapter unmerged, does not reproduce their log-probs bitwise; "
                         "roll out with engine.merge_lora false for an algorithm that takes a ratio")
    x = traj.latents[:, step]
    with execution_mode(traj.execution):
        v = trajectory_velocity(adapter, traj, x, traj.timesteps[:, step], step)
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
    for expert in denoiser_experts(denoiser).values():  # each expert of a two-expert model
        expert.enable_gradient_checkpointing(gradient_checkpointing_func=fn)
