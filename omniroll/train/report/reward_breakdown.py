"""What a batch's reward is made of: each reward function's own mean and the mean of each numeric extra a scorer
returned, besides the weighted sum (`rm_scores`) that GRPO trains on.

The reward manager records, in each row's `reward_extra_info`, every function's own score under `components` (also
a function with weight 0, e.g. a strict pass logged beside a partial-credit reward) and a scorer's extra keys (a
scorer may return dicts: `{"score": ..., "blue": ..., "green": ...}`) as `<fn>/<key>`. `reward_breakdown` averages
them over the rows that carry them:

    {"colour/mean": 0.11, "strict/mean": 0.25, "colour/blue": 0.31, "colour/green": 0.02}

A function that failed on a row (a flagged row: its component is None) is left out of that row. Only numbers count
(bools as 0 / 1; NaN and Inf left out); the manager's own bookkeeping per function (`attempts`, `time_s`, `error`) is
not an extra. `row_components` gives one row's components, for captions.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np

#: what the reward manager itself records per function in `reward_extra_info` (`<fn>/<key>`): not a scorer's extra
BOOKKEEPING = frozenset({"attempts", "time_s", "error"})


def _infos(batch: Any) -> list[dict]:
    rows = batch.non_tensor_batch.get("reward_extra_info") if batch is not None else None
    return [dict(i) if isinstance(i, dict) else {} for i in (rows if rows is not None else [])]


def _number(value: Any) -> Optional[float]:
    """A finite number as a float (bools as 0 / 1), else None."""
    if not isinstance(value, (bool, np.bool_, numbers.Real)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def row_components(batch: Any, i: int) -> dict[str, float]:
    """Row i's score of each reward function (its own, before the weights); a function that failed there is left
    out."""
    comps = _infos(batch)[i].get("components") or {}
    return {name: f for name, v in comps.items() if (f := _number(v)) is not None}


def reward_breakdown(batch: Any) -> dict[str, float]:
    """`<fn>/mean`: each reward function's own mean score (whatever its weight, also with a single function);
    `<fn>/<key>`: the mean of each numeric extra the scorer returned. Each over the rows that carry it; {} when the
    batch carries no reward info."""
    sums: dict[str, list[float]] = {}
    for info in _infos(batch):
        comps = info.get("components") or {}
        for name, value in comps.items():
            if (f := _number(value)) is not None:
                sums.setdefault(f"{name}/mean", []).append(f)
        for key, value in info.items():
            fn, sep, extra = key.partition("/")
            if not sep or fn not in comps or extra in BOOKKEEPING or extra == "mean":
                continue  # "<fn>/mean" is the function's own score above
            if (f := _number(value)) is not None:
                sums.setdefault(key, []).append(f)
    return {key: sum(vals) / len(vals) for key, vals in sums.items()}
