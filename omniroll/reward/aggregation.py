"""How several reward functions' scores become the one number a step trains on (`reward.aggregation`): `sum`, the
weighted sum (flow_grpo's `multi_score`; the `RewardManager` computes it per row), or `gdpo` (GDPO: each function's
score normalised within its prompt group first, then the weighted sum, whitened over the batch).

Pure functions on plain numbers (numpy float64); the trainer calls them (`omniroll.train.advantages`).

`gdpo`, for a batch of B rows in prompt groups g, functions k with weights w_k and scores r_k:

    z_k[i] = (r_k[i] - mean_{j in g(i)} r_k[j]) / (std_{j in g(i)} r_k[j] + eps)     each function, within its group
    s[i]   = sum_k w_k z_k[i]                                                           the configured weighted sum
    a[i]   = (s[i] - mean_B s) / (std_B s + eps)                                        whitened over the batch

std is the population std (divide by the count, `unbiased=False`), as `group_advantages` uses, and eps (1e-4, the
same) is added to the std, so a function that ties within a group contributes exactly 0 there, whatever its scale
(it says nothing about which sample of that group is better), and a batch whose every group ties gets all zeros.
Under a plain weighted sum a function with a large spread drowns one with a small spread; here each is heard in units
of its own within-group spread, and the weights say how much each counts.

A component a row lacks (a function that failed on it) has no group statistics to be normalised with: it is an error
naming the function and the sample (`check_components`), never a 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

#: the values of `reward.aggregation`
AGGREGATIONS = ("sum", "gdpo")
#: added to every std (the group's of one function, the batch's of the weighted sum); `group_advantages`' eps
EPS = 1e-4


@dataclass
class GdpoScores:
    """`scores`: [B] the whitened weighted sum (`a` above); per function: `group_std` (the mean over the groups of
    its within-group std, what it is divided by) and `tied_groups` (groups where it ties: it teaches nothing there)."""

    scores: np.ndarray
    group_std: dict[str, float] = field(default_factory=dict)
    tied_groups: dict[str, int] = field(default_factory=dict)


def group_rows(groups: Sequence) -> list[list[int]]:
    """The row indices of each group, groups in order of first appearance."""
    ids: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        ids.setdefault(g, []).append(i)
    return list(ids.values())


def group_normalise(values: Sequence[float], groups: Sequence, eps: float = EPS) -> tuple[np.ndarray, float, int]:
    """(values - their group's mean) / (their group's population std + eps); also the mean over groups of the
    within-group std and how many groups tie (every value equal: all zeros there)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(groups) != v.size:
        raise ValueError(f"groups has {len(groups)} entries for {v.size} values")
    out = np.zeros_like(v)
    stds, tied = [], 0
    for rows in group_rows(groups):
        vals = v[rows]
        if bool((vals == vals[0]).all()):
            tied += 1
            stds.append(0.0)
            continue  # exactly 0: a tie says nothing
        sd = float(vals.std())  # population std (ddof 0)
        stds.append(sd)
        out[rows] = (vals - vals.mean()) / (sd + eps)
    return out, float(np.mean(stds)) if stds else 0.0, tied


def whiten(values: Sequence[float], eps: float = EPS) -> np.ndarray:
    """(values - their mean) / (their population std + eps) over the whole batch."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    return (v - v.mean()) / (v.std() + eps) if v.size else v


def gdpo_scores(components: Mapping[str, Sequence[float]], weights: Mapping[str, float], groups: Sequence,
                eps: float = EPS) -> GdpoScores:
    """GDPO's aggregated score per row (module doc). components: function name -> [B] its scores (finite numbers:
    `check_components`); weights: function name -> its weight (every component needs one)."""
    if not components:
        raise ValueError("gdpo needs at least one reward component")
    missing = [name for name in components if name not in weights]
    if missing:
        raise ValueError(f"reward component(s) {missing} have no weight (functions: {sorted(weights)})")
    total = np.zeros(len(groups), dtype=np.float64)
    out = GdpoScores(total)
    for name, values in components.items():
        z, sd, tied = group_normalise(values, groups, eps)
        total += float(weights[name]) * z
        out.group_std[name], out.tied_groups[name] = sd, tied
    out.scores = whiten(total, eps)
    return out


def _finite(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def check_components(rows: Sequence[Mapping[str, Any]], names: Sequence[str],
                     sample_ids: Sequence[str]) -> dict[str, list[float]]:
    """Each row's score of each function in `names`, as function -> [B]; a row that lacks one (None, absent, not a
    finite number) is a ValueError naming every such function and sample, never a 0."""
    if len(rows) != len(sample_ids):
        raise ValueError(f"{len(rows)} rows of components for {len(sample_ids)} sample ids")
    bad = [f"{name!r} for sample {sid!r} (got {row.get(name)!r})" for row, sid in zip(rows, sample_ids)
           for name in names if not _finite(row.get(name))]
    if bad:
        raise ValueError("reward.aggregation gdpo normalises every reward function within its group, and these "
                         "scores are missing: " + "; ".join(bad))
    return {name: [float(row[name]) for row in rows] for name in names}
