"""Per-timestep ratio statistics: the importance ratio's mean and std, its clip fractions above and below, and the mean
absolute log-prob difference, per denoising step index, from sums that add across micro-batches, inner epochs and
data-parallel ranks.

    sums = {}
    for each loss term (a micro-batch's rows at one window step each):
        add_step_sums(sums, ratio_step_sums(terms.steps, terms.log_ratio, terms.log_prob_diff, terms.ratio,
                                            terms.clipped))
    # ranks: add_step_sums(sums, other_rank_sums)                 (omniroll/train/parallel/shard.py `merge_stats`)
    record.update(ratio_step_metrics(sums))

Per step index t (the trajectory's denoising step: 0 is the first, noisiest one; a window's step k of a row whose
window starts at s is s + k), over every (row, epoch) term scored at t, the sums are n, sum(r - 1), sum((r - 1)^2),
the clipped terms with r > 1 and with r < 1, and sum(|log-prob difference|), with r - 1 = expm1(log ratio) in fp64 (a
ratio within 1e-7 of 1 keeps its digits). The record (`ratio_step_metrics`), for every t and over all t:

    ratio_mean         1 + sum(r - 1) / n
    ratio_std          sqrt(sum((r - 1)^2) / n - (sum(r - 1) / n)^2)      (the population std)
    clip_frac_higher   share of terms clipped with r > 1 + eps   (VeRL-Omni's pg_clipfrac_higher)
    clip_frac_lower    share of terms clipped with r < 1 - eps   (pg_clipfrac_lower); the two add up to clip_frac
    log_prob_abs_diff  mean |logp_theta - logp_anchor| (the recorded mean log-probs; GRPO-Guard's ratio is built from
                       it and the transition means, so for it this is the un-normalised difference)
    ratio_samples      n, the terms behind the step's numbers

keyed `<name>_ts_<t>` per step and `<name>` over all steps (trackers: `actor/ratio_mean_ts_3`, ...;
omniroll/train/report/tracking.py). Not `<name>/ts_<t>`: a tracker that keeps a metric as a file (MLflow's file store)
cannot hold `actor/ratio_mean` and `actor/ratio_mean/ts_3`, a file and a folder of one name. Every term before the
step's first optimizer update has r == 1 exactly (a sample of the weights that train it; GRPO-Guard's ratio of a stale
sample also carries the policy's move since), so with one optimizer update per step the means are 1 and the stds 0.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import torch

#: the sums kept per step index, in this order
SUMS = ("n", "dev", "dev_sq", "high", "low", "abs_diff")
#: the names the record gives each statistic, per step (`<name>_ts_<t>`: `step_key`) and over all steps
NAMES = ("ratio_mean", "ratio_std", "clip_frac_higher", "clip_frac_lower", "log_prob_abs_diff", "ratio_samples")
_STEP_KEY = re.compile(r"^(?P<name>.+)_ts_(?P<t>\d+)$")


def step_key(name: str, t: int) -> str:
    """The record's key of statistic `name` at denoising step index t: `<name>_ts_<t>`."""
    return f"{name}_ts_{int(t)}"


def split_step_key(key: str) -> Optional[tuple[str, int]]:
    """(name, t) of a per-step key of one of NAMES (`step_key`'s), else None."""
    m = _STEP_KEY.match(key)
    return (m["name"], int(m["t"])) if m and m["name"] in NAMES else None


def ratio_step_sums(steps: torch.Tensor, log_ratio: torch.Tensor, log_prob_diff: Optional[torch.Tensor],
                    ratio: torch.Tensor, clipped: torch.Tensor) -> dict[int, list[float]]:
    """{step index t: [n, sum(r - 1), sum((r - 1)^2), clipped with r > 1, clipped with r < 1, sum |log-prob diff|]}
    of one loss term's rows. steps [B]: each row's denoising step index; log_ratio [B]: log r; log_prob_diff [B]:
    logp_theta - logp_anchor (None: log_ratio); ratio [B] and clipped [B] (bool): the loss's own, so the clip fractions
    add up to its clip_frac."""
    B = int(steps.numel())
    for name, t in (("log_ratio", log_ratio), ("ratio", ratio), ("clipped", clipped)) + (
            (("log_prob_diff", log_prob_diff),) if log_prob_diff is not None else ()):
        if t.numel() != B:
            raise ValueError(f"ratio_step_sums: {name} has {t.numel()} values, steps has {B}")
    if log_prob_diff is None:
        log_prob_diff = log_ratio
    steps = steps.detach().reshape(-1).cpu().long()
    dev = torch.expm1(log_ratio.detach().reshape(-1).cpu().double())
    r = ratio.detach().reshape(-1).cpu()
    c = clipped.detach().reshape(-1).cpu().bool()
    cols = torch.stack([torch.ones_like(dev), dev, dev * dev, (c & (r > 1)).double(), (c & (r < 1)).double(),
                        log_prob_diff.detach().reshape(-1).cpu().double().abs()], 1)  # [B, 6]
    out: dict[int, list[float]] = {}
    for t in torch.unique(steps).tolist():
        out[int(t)] = cols[steps == t].sum(0).tolist()
    return out


def add_step_sums(into: dict[int, list[float]], sums: dict[int, list[float]]) -> dict[int, list[float]]:
    """`sums` added into `into` (in place, step by step; returned)."""
    for t, v in sums.items():
        if len(v) != len(SUMS):
            raise ValueError(f"add_step_sums: step {t} has {len(v)} sums, expected {len(SUMS)} ({', '.join(SUMS)})")
        have = into.setdefault(int(t), [0.0] * len(SUMS))
        for i, x in enumerate(v):
            have[i] += float(x)
    return into


def _stats(n: float, dev: float, dev_sq: float, high: float, low: float, abs_diff: float) -> list[float]:
    m = dev / n
    return [1.0 + m, math.sqrt(max(dev_sq / n - m * m, 0.0)), high / n, low / n, abs_diff / n, n]


def ratio_step_metrics(sums: dict[int, list[float]]) -> dict[str, float]:
    """The record's keys (module doc) from the summed `sums`: every statistic over all steps, then per step index in
    order; {} when no term reported a ratio (the forward-process algorithms)."""
    steps = sorted(t for t, v in sums.items() if v[0] > 0)
    if not steps:
        return {}
    total = [sum(sums[t][i] for t in steps) for i in range(len(SUMS))]
    out = dict(zip(NAMES, _stats(*total)))
    for t in steps:
        out.update({step_key(name, t): v for name, v in zip(NAMES, _stats(*sums[t]))})
    out["ratio_samples"] = int(out["ratio_samples"])
    for t in steps:
        out[step_key("ratio_samples", t)] = int(out[step_key("ratio_samples", t)])
    return out
