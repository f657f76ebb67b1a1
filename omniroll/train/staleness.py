"""Which rows of an asynchronous batch may train: the version that ran each window step (`step_versions`; a
forward-process row: the oldest version it saw), its staleness (`staleness_stats`), the rows too new (`rows_ahead`:
`WeightVersionError`) or too old (`stale_rows`) to train, the rows that may (`trainable_rows`), and a step's
staleness and exactness metrics (`off_policy_metrics`)."""

from __future__ import annotations

from typing import Callable

import torch


class WeightVersionError(RuntimeError):
    """A sample was generated with weights the trainer never pushed, or a weight sync failed."""


def step_versions(batch, num_steps: int) -> torch.Tensor:
    """[B, W] weight version of every window step: the engine's `step_weight_versions` when the batch carries them,
    else each sample's `weight_version` repeated (exact when no sample spans a weight sync). num_steps 0 (a
    forward-process batch, no window): [B, 1], each sample's oldest version (`min_weight_version`)."""
    nt = batch.non_tensor_batch
    if num_steps == 0:
        key = "min_weight_version" if "min_weight_version" in nt else "weight_version"
        return torch.tensor([int(v) for v in nt[key]], dtype=torch.long)[:, None]
    if "step_weight_versions" in nt:
        rows = [list(map(int, v)) for v in nt["step_weight_versions"]]
        bad = [i for i, r in enumerate(rows) if len(r) != num_steps]
        if bad:
            raise ValueError(f"step_weight_versions of rows {bad[:8]} do not have {num_steps} entries (one per "
                             f"recorded window step)")
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), num_steps)
    if "weight_version" not in nt:
        raise ValueError("the batch carries no weight versions (weight_version / step_weight_versions): its samples "
                         "cannot be trained on")
    return torch.tensor([int(v) for v in nt["weight_version"]], dtype=torch.long)[:, None].repeat(1, num_steps)


def staleness_stats(versions: torch.Tensor, current: int) -> dict:
    """staleness (current - version) of every window step, and the largest version span within one sample."""
    if versions.numel() == 0:
        return {"staleness_min": 0, "staleness_mean": 0.0, "staleness_max": 0, "version_span_max": 0}
    s = (current - versions).double()
    span = versions.max(1).values - versions.min(1).values
    return {"staleness_min": int(s.min()), "staleness_mean": float(s.mean()), "staleness_max": int(s.max()),
            "version_span_max": int(span.max())}


def rows_ahead(versions, current: int) -> list[int]:
    """Rows with a window step that ran with a version newer than `current` (one the trainer never pushed)."""
    high = versions.max(1).values
    return [i for i in range(len(high)) if int(high[i]) > current]


def stale_rows(versions, current: int, max_staleness: int) -> list[int]:
    """Rows with a window step that ran with a version older than current - max_staleness."""
    low = versions.min(1).values
    return [i for i in range(len(low)) if int(low[i]) < current - max_staleness]


def trainable_rows(step: int, batch, current: int, max_staleness: int, on_stale: str, regenerate: Callable[[], object],
                   log: Callable[[str], None]) -> tuple[object, torch.Tensor, dict]:
    """The batch's samples that may train at trainer version `current`: every window step ran with a version the
    trainer pushed (else `WeightVersionError`), none older than current - max_staleness (`on_stale`: "drop" them, or
    "wait": `regenerate()` the batch with the same rows and seeds under the current weights). Returns (the rows, their
    [B, W] versions, {"stale_dropped", "stale_regenerated"})."""
    W = int(batch.batch["rollout_log_probs"].shape[1]) if "rollout_log_probs" in batch.batch.keys() else 0
    versions = step_versions(batch, W)
    ahead = [(batch.non_tensor_batch["request_id"][i], int(versions[i].max())) for i in rows_ahead(versions, current)]
    if ahead:
        raise WeightVersionError(f"step {step}: {len(ahead)} sample(s) were generated with weights the trainer never "
                                 f"pushed (trainer at version {current}): {ahead[:8]}")
    stale = stale_rows(versions, current, max_staleness)
    if stale and on_stale == "wait":
        log(f"step {step}: {len(stale)} sample(s) older than max_staleness: regenerating the batch")
        again = trainable_rows(step, regenerate(), current, max_staleness, on_stale, regenerate, log)
        return again[0], again[1], {**again[2], "stale_regenerated": len(batch) + again[2]["stale_regenerated"]}
    if stale:
        drop = set(stale)
        keep = [i for i in range(len(batch)) if i not in drop]
        batch, versions = batch[keep], versions[keep]
    return batch, versions, {"stale_dropped": len(stale), "stale_regenerated": 0}


def off_policy_metrics(stats, versions: torch.Tensor, prox_version: int) -> dict:
    """A step's staleness and exactness metrics (docs/training/async.md)."""
    return {**staleness_stats(versions, prox_version),
            "prox_ratio_max_abs_dev": stats.ratio_max_abs_dev, "behaviour_ratio_mean": stats.behaviour_ratio_mean,
            "behaviour_ratio_max_abs_dev": stats.behaviour_ratio_max_abs_dev,
            "behaviour_weight_capped_frac": stats.behaviour_weight_capped_frac}
