"""A training step's record: the one dict the step line, `metrics.jsonl` and the trackers read, built from what each
phase of the step returned (rewards and advantages, the update's result, the versions, the clock readings).

Its keys are the trainer's metric names (docs/troubleshooting.md reads each one); `tracking.tracker_name` maps them
to verl's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from omniroll.train.async_rollout import overlap_seconds
from omniroll.train.ratio_steps import ratio_step_metrics
from omniroll.train.update import UpdateResult
from omniroll.train.staleness import off_policy_metrics


@dataclass
class StepClock:
    """The step's clock readings (time.time()): t0 its start, back the rollout's batch in hand, rollout the
    rollout's (start, end) span, last_generated the last sample's end of generation, t1 the update's start, t2 its end,
    t3 the sync's end; busy the rollout pipeline's busy intervals within the step."""

    t0: float
    back: float
    rollout: tuple[float, float]
    last_generated: float
    t1: float
    t2: float
    t3: float
    busy: list


def step_record(step: int, rewards: torch.Tensor, adv, update: UpdateResult, signal: dict, versions: torch.Tensor, *,
                synced_version: int, prox_version: int, max_staleness: int, partial_rollout: bool, stale: dict,
                clock: StepClock, sleep_s: Optional[float], wake_s: Optional[float], memory: dict) -> dict:
    """The step's record. adv: the step's `Advantages`; update: the updater's result (omniroll/train/update.py);
    signal: the gradient-signal meter's metrics; stale: the stale rows' counts; memory: the peaks per stage."""
    stats = update.stats
    n = len(rewards)
    wall = clock.t3 - clock.t0
    m = {"step": step, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
         "reward_max": float(rewards.max()), "tied_groups": adv.tied_groups, "tied_rewards": adv.tied_rewards,
         "num_groups": adv.num_groups, "num_samples": n, **adv.metrics,
         "ratio_max_abs_dev": stats.ratio_max_abs_dev, "clip_frac": stats.clip_frac,
         "approx_kl": stats.approx_kl, "loss": stats.loss, "policy_loss": stats.policy_loss, "kl": stats.kl,
         "grad_norm": stats.grad_norm, "optimizer_steps": stats.optimizer_steps, **signal, **update.move,
         "weight_version": int(versions.min()), "synced_version": synced_version,
         "max_staleness": max_staleness, "partial_rollout": partial_rollout, **stale, **update.prepared,
         **update.after, **off_policy_metrics(stats, versions, prox_version),
         "overlap_frac": overlap_seconds(clock.busy, [(clock.t1, clock.t2)]) / max(wall, 1e-9),
         "samples_per_s": n / max(wall, 1e-9),
         "rollout_s": max(clock.rollout[1] - clock.rollout[0], 0.0),
         "reward_wait_s": max(clock.rollout[1] - clock.last_generated, 0.0),
         "rollout_wait_s": clock.back - clock.t0, "train_s": clock.t2 - clock.t1 - update.move_s,
         "sync_s": clock.t3 - clock.t2, "step_s": wall, "policy_move_s": update.move_s}
    if sleep_s is not None:  # colocated replicas (train/colocation.py): sync_s without the wake before it
        m.update(sleep_s=sleep_s, wake_s=wake_s, sync_s=m["sync_s"] - wake_s)
    m.update(recompute_s=update.recompute_s,  # the anchors (in train_s)
             **memory)  # peak_mem_<stage>_gb where the device reports memory
    # the ratio's mean, std, clip fractions and |log-prob difference|, overall and per denoising step index (`..._ts_3`;
    # omniroll/train/ratio_steps.py): none for an algorithm without a ratio
    m.update(ratio_step_metrics(stats.ratio_steps))
    return m
