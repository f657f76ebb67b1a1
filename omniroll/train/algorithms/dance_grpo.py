"""DanceGRPO (arXiv 2505.07818; XueZeyue/DanceGRPO `train_grpo_flux.py`): Flow-GRPO's clipped objective on a
constant-eta SDE, with a prompt's group sharing its initial noise and a random subset of steps trained per sample.

Rollout: `algo.sde_type: dance_sde`, whose step std is eta * sqrt(sigma_i - sigma_{i+1}) (omniroll/sampling/sde.py;
Flow-GRPO's is eta * sqrt(sigma / (1 - sigma)) * sqrt(sigma_i - sigma_{i+1})), and `algo.same_latent: true` (the
reference's `--init_same_noise`: the samples of a group start from one noise and differ only by the SDE's draws).
Advantages: per group, the group's std (the reference's). Loss: Flow-GRPO's PPO-clip, no KL by default, on
int(W * timestep_fraction) of the row's W recorded steps, drawn per row (the reference's `timestep_fraction` 0.6 and
its per-sample permutation), each row at its own step in one forward (`TrajectoryBatch.at_steps`).

Scaled here: the reference trains FLUX.1-dev's 16 steps, all SDE but the last; omniroll trains the recorded window
(`algo.sde_window_size`; None: every step but the last, as the reference).
"""

from __future__ import annotations

import torch

from omniroll.sampling.seeds import trained_steps_seed
from omniroll.train.algorithms.base import UpdatePlan
from omniroll.train.algorithms.flow_grpo import FlowGRPO
from omniroll.train.trajectory_batch import TrajectoryBatch


def trained_steps(num_rows: int, num_steps: int, fraction: float, seed: int, step: int) -> torch.Tensor:
    """[B, int(W * fraction) (at least 1)]: each row's trained window steps, the first of a permutation drawn per
    row from (seed, step) only (a resumed run draws the same)."""
    g = torch.Generator().manual_seed(trained_steps_seed(seed, step))
    n = max(1, int(num_steps * fraction))
    return torch.stack([torch.randperm(num_steps, generator=g)[:n] for _ in range(num_rows)]) if num_rows else \
        torch.empty(0, n, dtype=torch.long)


class DanceGRPO(FlowGRPO):
    name = "dance_grpo"

    def train_steps(self, rows: TrajectoryBatch, plan: UpdatePlan) -> torch.Tensor:
        return trained_steps(len(rows), rows.num_steps, self.options.timestep_fraction, plan.seed, plan.step)
