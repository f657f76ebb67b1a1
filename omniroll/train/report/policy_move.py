"""How far one training step moved the policy: its transitions before and after the step's update, on a fixed subset
of the step's rows.

`approx_kl` and `clip_frac` of `train_on_batch` are measured while it trains, against the anchor: with one optimizer
update per step every term is scored before that update, so they are always 0 and say nothing of the move. Here the
first min(B, `trainer.policy_move_rows`) rows of the step are scored at every recorded window step, without grad and
in the rollout's execution mode (`recompute_log_probs`), once with the weights before `train_on_batch` (`snapshot`
before it) and once with the weights after it (`snapshot` after); `policy_move` compares the two:

- `policy_kl`: the exact KL between the two transition Gaussians of a window step, per latent element. Both have the
  same std s (it does not depend on the weights), so KL = mean over elements of (mu_new - mu_old)^2 / (2 s^2),
  averaged over the rows and window steps (a deterministic step, s == 0, has no density and is left out). s is the
  transition's own std for every SDE type (`sde_step`'s `std`). `kl_to_reference` (the loss's KL term, flow_grpo's
  convention) gives the same for cps and dance_sde; for sde it divides by std_dev_t^2 = s^2 / |dt| instead, i.e.
  it is this KL times |dt|.
- `post_approx_kl`: PPO's 0.5 mean((logp_new - logp_old)^2) over the rows and window steps, with Flow-GRPO's mean
  log-probs (the same convention as `approx_kl`).
- `post_clip_frac`: the share of (row, window step) with |exp(logp_new - logp_old) - 1| > `clip_range`: the terms the
  next update would clip if it started from these samples.

A step whose update changed nothing reports exactly 0.0 for all three (the two recomputes are bitwise equal: same
weights, same kernels). The measurement reads the weights and changes nothing: no grad, no random draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from omniroll.train.recompute import recompute_log_probs
from omniroll.train.trajectory_batch import TrajectoryBatch


@dataclass
class Snapshot:
    """The subset's transitions under one set of weights: log_prob [R, W]; mean: W tensors [R, ...]; std [R, W]."""

    log_prob: torch.Tensor
    mean: list[torch.Tensor]
    std: torch.Tensor


@torch.no_grad()
def snapshot(adapter, traj: TrajectoryBatch, rows: int, micro_batch_size: int) -> Optional[Snapshot]:
    """The first min(len(traj), rows) rows' log-prob, Gaussian mean and std at every window step under `adapter`'s
    current weights (None when rows == 0, or for rows without transitions, a forward-process `CleanBatch`: not
    measured)."""
    R = min(len(traj), int(rows))
    if R <= 0 or not isinstance(traj, TrajectoryBatch):
        return None
    sub = traj.rows(list(range(R)))
    log_prob = torch.empty(R, sub.num_steps)
    std = torch.empty(R, sub.num_steps)
    mean = []
    for k in range(sub.num_steps):
        parts = [recompute_log_probs(adapter, sub.rows(chunk), k) for chunk in torch.arange(R).split(micro_batch_size)]
        log_prob[:, k] = torch.cat([p.log_prob.float() for p in parts]).cpu()  # kept on the host
        std[:, k] = torch.cat([p.std.float() for p in parts]).cpu()
        mean.append(torch.cat([p.mean.float() for p in parts]).cpu())
    return Snapshot(log_prob=log_prob, mean=mean, std=std)


def policy_move(before: Optional[Snapshot], after: Optional[Snapshot], clip_range: float) -> dict:
    """`policy_kl`, `post_approx_kl` and `post_clip_frac` between two snapshots of the same rows (module doc); {} when
    nothing was measured."""
    if before is None or after is None:
        return {}
    kls = []
    for k, (old, new) in enumerate(zip(before.mean, after.mean)):
        s = before.std[:, k].double()
        live = s > 0
        sq = ((new.double() - old.double()) ** 2).reshape(len(s), -1).mean(1)
        kls.append((sq[live] / (2 * s[live] ** 2)))
    kl = torch.cat(kls)
    d = (after.log_prob - before.log_prob).double()
    return {"policy_kl": float(kl.mean()) if kl.numel() else 0.0,
            "post_approx_kl": float(0.5 * (d * d).mean()),
            "post_clip_frac": float(((torch.exp(d) - 1.0).abs() > clip_range).double().mean())}
