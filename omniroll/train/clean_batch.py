"""`CleanBatch`: the rows a forward-process algorithm (DiffusionNFT, AWM) trains on: each sample's clean final latent
x0, its conditioning and its sampling schedule; no trajectory, no log-prob.

Its rollout is a deterministic ODE with `logprobs` off and `output_type` "both": the engine keeps nothing but the
final latent (`latents`) beside the pixels the reward scores. The schedule is the adapter's own (`adapter.sigmas`, the
function the engine's admission calls) for the row's recorded sampling parameters, so the training timesteps are the
sampling ones exactly. `velocity` is the model's conditional velocity at (x_t, sigma) through the trainer's recompute
path (`trajectory_velocity`: CFG off, the rollout's execution mode), with autograd when grad is enabled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from omniroll.engine.execution import execution_mode
from omniroll.train.recompute import trajectory_velocity
from omniroll.train.trajectory_batch import batch_columns, conditioning_columns, one_execution
from omniroll.train.rows import rows_to, take_rows


@dataclass
class CleanBatch:
    """B rows. x0 [B, ...] fp32 (the rollout's final latent); sigmas [B, T + 1] fp32 (the row's schedule, from 1 down
    to 0); guidance_scale [B] (a distilled-guidance model's input); cond: conditioning tensors [B, ...] with `lengths`
    [B] of real tokens for the padded ones; weight_version: B ints; execution: the engine's mode."""

    x0: torch.Tensor
    sigmas: torch.Tensor
    guidance_scale: torch.Tensor
    cond: dict[str, torch.Tensor]
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_version: list[int] = field(default_factory=list)
    execution: dict = field(default_factory=dict)
    uncond: None = None  # the loss's velocity is conditional only (CFG off)
    experts: Optional[torch.Tensor] = None  # [B, 1] during a velocity call on a multi-expert family

    def __len__(self) -> int:
        return int(self.x0.shape[0])

    @property
    def num_steps(self) -> int:
        """T: the sampling steps of every row."""
        return int(self.sigmas.shape[1]) - 1

    def rows(self, idx: Sequence[int] | torch.Tensor) -> "CleanBatch":
        return take_rows(self, idx)

    def to(self, device: str | torch.device) -> "CleanBatch":
        """The rows on `device` (`rows_to`)."""
        return rows_to(self, device)

    @classmethod
    def from_batch(cls, batch: Any, adapter) -> "CleanBatch":
        """From the agent loop's output `DataBatch` of a forward-process rollout (`latents` and `sampling_params` per
        row). `adapter`: the trainer's model, whose `sigmas` gives each row's schedule."""
        td, nt = batch_columns(batch, ["latents"], ["sampling_params", "execution", "weight_version"],
                               "the clean final latent: was it generated with output_type 'both'?")
        cond, _, lengths = conditioning_columns(td)  # the loss's velocity is conditional only
        sched = []
        for sp in nt["sampling_params"]:
            sp = dict(sp)
            sched.append(adapter.sigmas(int(sp["num_inference_steps"]), int(sp["height"]), int(sp["width"]),
                                        int(sp.get("num_frames", 1))).float())
        if len({s.numel() for s in sched}) != 1:
            raise ValueError("rows of one batch must share num_inference_steps")
        return cls(x0=td["latents"].float(), sigmas=torch.stack(sched), guidance_scale=td["guidance_scale"].float(),
                   cond=cond, lengths=lengths, weight_version=[int(v) for v in nt["weight_version"]],
                   execution=one_execution(list(nt["execution"])))

    def velocity(self, adapter, x_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The conditional velocity [B, ...] at per-row sigma [B] (timestep = 1000 sigma, as the engine feeds it), in
        the rollout's execution mode; with autograd when grad is enabled."""
        timesteps = sigma.float() * 1000.0
        view = self
        if getattr(adapter, "num_experts", 1) > 1:
            view = replace(self, experts=torch.tensor([[adapter.expert_index(float(t))] for t in timesteps]))
        with execution_mode(self.execution):
            return trajectory_velocity(adapter, view, x_t, timesteps, 0)
