"""A step's batch split across the data-parallel trainer ranks by whole prompt groups (`shard_by_groups`), the rows
of every global optimizer step (`rows_per_update`), and the ranks' update metrics merged into one (`merge_stats`).

    shards = shard_by_groups(uids, world_size)          # one list of row indices per rank (whole groups, in order)
    rows = rows_per_update([len(s) for s in shards], micro_batch_size, per_update, rows_a)
    stats = merge_stats([stats_of_rank_0, stats_of_rank_1])    # one UpdateStats for the step's record

Rank r trains the contiguous block of prompt groups [r G / N, (r + 1) G / N) in order of first appearance, so every
group's rows stay on one rank; the advantages are computed on the whole batch before the split. A global optimizer
step u joins every rank's accumulation group u (omniroll/train/micro_batches.py: its micro-batches u * per_update ...
(u + 1) * per_update - 1, cut half by half of the gradient-signal meter's split); its gradient is the mean over those
rows (`rows_per_update` gives their count, each rank scales its loss by it).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional, Sequence

from omniroll.train.micro_batches import group_rows
from omniroll.train.ratio_steps import add_step_sums
from omniroll.train.update import UpdateStats


def shard_by_groups(uids: Sequence, world_size: int) -> list[list[int]]:
    """Row indices per rank: whole prompt groups (rows sharing a uid), a contiguous block of groups per rank."""
    order: dict = {}
    for i, u in enumerate(uids):
        order.setdefault(u, []).append(i)
    groups = list(order.values())
    G = len(groups)
    return [sorted(i for g in groups[r * G // world_size:(r + 1) * G // world_size] for i in g)
            for r in range(world_size)]


def rows_per_update(shard_sizes: Sequence[int], micro_batch_size: int, per_update: Optional[int],
                    rows_a: Optional[Sequence[int]] = None) -> list[int]:
    """Rows in each global optimizer step of one inner epoch: the sum over ranks of the rows in their accumulation
    group u (a rank that has fewer groups adds none; the ranks still step together). rows_a: each rank's rows in the
    meter's half A (None: no halves); per_update None: one step per epoch."""
    per_rank = [group_rows(B, rows_a[r] if rows_a is not None else None, micro_batch_size, per_update)
                for r, B in enumerate(shard_sizes)]
    U = max((len(g) for g in per_rank), default=0)
    return [sum(g[u] for g in per_rank if u < len(g)) for u in range(U)]


def merge_stats(stats: Sequence[UpdateStats]) -> UpdateStats:
    """One step's metrics from every rank's: maxima for the deviations, rank 0's gradient norm, optimizer steps and
    gradient-signal readings (the meter's and its per-component ones, the same on every rank: they act on all-reduced
    gradients), the behaviour ratio's mean and capped share weighted by each rank's (row, term) pairs that reported
    it, the per-timestep ratio sums added up (a step's mean is over every rank's samples at that step, its std from
    their sums of squares), the other fractions and means by each rank's scored (row, term) count."""
    rows = [s.scored for s in stats]
    total = max(sum(rows), 1)
    behaviour = [s.behaviour_scored for s in stats]
    behaviour_total = sum(behaviour)
    out = {}
    for f in fields(UpdateStats):
        vals = [getattr(s, f.name) for s in stats]
        if f.name in ("ratio_max_abs_dev", "behaviour_ratio_max_abs_dev"):
            out[f.name] = max(vals)
        elif f.name in ("grad_norm", "optimizer_steps", "grad_cos", "signal_rows_a", "signal_rows_b",
                        "component_cos", "data_loss"):  # data_loss: None, the regulariser runs with one process
            out[f.name] = vals[0]
        elif f.name in ("scored", "behaviour_scored"):
            out[f.name] = sum(vals)
        elif f.name == "ratio_steps":
            out[f.name] = {}
            for v in vals:
                add_step_sums(out[f.name], v)
        elif f.name in ("behaviour_ratio_mean", "behaviour_weight_capped_frac"):  # over the terms that reported one
            out[f.name] = (sum(v * n for v, n in zip(vals, behaviour)) / behaviour_total if behaviour_total
                           else vals[0])
        else:
            out[f.name] = sum(v * n for v, n in zip(vals, rows)) / total
    return UpdateStats(**out)
