"""The behaviour log-probs of an asynchronous batch: every recorded window step rescored under the weight version
that ran it (`log_probs_under_versions`), and what the loss uses with the replay check of the recorded ones
(`behaviour_and_replay`)."""

from __future__ import annotations

from typing import Optional

import torch

from omniroll.train.recompute import recompute_log_probs
from omniroll.train.trajectory_batch import TrajectoryBatch
from omniroll.train.version_store import VersionStore


@torch.no_grad()
def log_probs_under_versions(store: VersionStore, traj: TrajectoryBatch, versions: torch.Tensor,
                             micro_batch_size: int, field: str = "log_prob") -> torch.Tensor:
    """[B, W] log-prob (`field`: or any other output of the step, e.g. "mean": [B, W, ...]) of every recorded window
    step under the version that ran it (no grad; the rollout's execution mode). Rows are scored in micro-batches of
    one version per step (batch invariance makes the grouping irrelevant to the values)."""
    B, W = versions.shape
    out = None
    for v in sorted(set(versions.flatten().tolist())):
        with store.weights(v):
            for k in range(W):
                rows = (versions[:, k] == v).nonzero().flatten()
                for chunk in rows.split(micro_batch_size) if len(rows) else ():
                    got = getattr(recompute_log_probs(store.policy.adapter, traj.rows(chunk), k), field).float()
                    if out is None:
                        out = torch.empty((B, W) + tuple(got.shape[1:]), dtype=torch.float32, device=got.device)
                    out[chunk, k] = got
    return out if out is not None else torch.empty(B, W, dtype=torch.float32)


def behaviour_and_replay(store: VersionStore, traj: TrajectoryBatch, versions: torch.Tensor, *, old_log_prob: str,
                         decoupled: bool, micro_batch_size: int,
                         replay_rows: int) -> tuple[Optional[torch.Tensor], float]:
    """The behaviour log-probs the loss uses (None: plain PPO-clip against the recorded ones) and
    `behaviour_replay_max_abs_dev`: the first `replay_rows` rows' recorded log-probs against their recompute under
    the versions that ran them (with `old_log_prob: recompute` that recompute is the behaviour itself)."""
    sub = list(range(min(replay_rows, len(traj))))
    if old_log_prob == "recompute":
        behaviour = log_probs_under_versions(store, traj, versions, micro_batch_size)
        replay = behaviour[sub]
    else:
        replay = log_probs_under_versions(store, traj.rows(sub), versions[sub], micro_batch_size)
        behaviour = traj.log_probs if decoupled else None
    return behaviour, float((replay - traj.log_probs[sub]).abs().max()) if sub else 0.0
