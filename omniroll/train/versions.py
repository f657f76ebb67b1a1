"""The weight versions of the asynchronous trainer: the trainable weights of the last versions (`VersionStore`), the
version that ran each window step of a batch (`step_versions`; a forward-process row: the oldest version it saw), its
staleness and the rows too old (`stale_rows`) or too new (`rows_ahead`) to train, the batch's rows that may train
(`trainable_rows`), and the behaviour log-probs recomputed under those versions (`behaviour_and_replay`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

import torch

from omniroll.train.policy import Policy
from omniroll.train.recompute import recompute_log_probs
from omniroll.train.trajectory_batch import TrajectoryBatch


class WeightVersionError(RuntimeError):
    """A sample was generated with weights the trainer never pushed, or a weight sync failed."""


class VersionStore:
    """The trainable weights of the last `keep` versions (LoRA: the adapter; full: every trained weight), so a window
    step can be rescored under the version that ran it. Memory: `keep` copies of the trained weights (none when
    keep == 0, the synchronous trainer)."""

    def __init__(self, policy: "Policy", keep: int):
        self.policy, self.keep = policy, int(keep)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.current: Optional[int] = None

    def record(self, version: int) -> None:
        """The policy's weights now are `version` (call after each optimizer update's sync, and at start)."""
        self.current = int(version)
        if self.keep > 0:
            self.snapshots[self.current] = [p.detach().clone() for p in self.policy.parameters()]
            for v in [v for v in self.snapshots if v < self.current - self.keep]:
                del self.snapshots[v]

    def has(self, version: int) -> bool:
        return version == self.current or version in self.snapshots

    @contextlib.contextmanager
    def weights(self, version: int) -> Iterator[None]:
        """The policy holds `version`'s weights inside the block (exact copies), its current ones after."""
        if version == self.current:
            yield
            return
        if version not in self.snapshots:
            raise KeyError(f"weight version {version} is not kept (kept: {sorted(self.snapshots)}, current "
                           f"{self.current}); the trainer keeps max_staleness + 1 versions")
        params = self.policy.parameters()
        with torch.no_grad():
            for p, s in zip(params, self.snapshots[version]):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(params, self.snapshots[self.current]):
                    p.copy_(s)

    def adopt(self, snapshots: dict[int, list[torch.Tensor]], current: int) -> None:
        """Another store's kept versions (a data-parallel rank takes the trainer's), then `record(current)`."""
        self.snapshots = {int(v): [t.clone() for t in snap] for v, snap in snapshots.items()}
        self.record(current)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """`versions.safetensors`: every kept version's weights (a resumed run regenerates in-flight batches with
        them)."""
        from safetensors.torch import save_file

        names = [n for n, _ in self.policy.named_parameters()]
        tensors = {f"{v}/{n}": t.contiguous() for v, snap in self.snapshots.items() for n, t in zip(names, snap)}
        if tensors:
            save_file(tensors, os.path.join(path, "versions.safetensors"))

    def load(self, path: str, current: int) -> None:
        from safetensors.torch import load_file

        f = os.path.join(path, "versions.safetensors")
        names = [n for n, _ in self.policy.named_parameters()]
        loaded = load_file(f) if os.path.isfile(f) else {}
        versions = sorted({int(k.split("/", 1)[0]) for k in loaded})
        self.snapshots = {v: [loaded[f"{v}/{n}"] for n in names] for v in versions if v >= current - self.keep}
        self.record(current)


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


def off_policy_metrics(stats, versions: torch.Tensor, prox_version: int) -> dict:
    """A step's staleness and exactness metrics (docs/training/async.md)."""
    return {**staleness_stats(versions, prox_version),
            "prox_ratio_max_abs_dev": stats.ratio_max_abs_dev, "behaviour_ratio_mean": stats.behaviour_ratio_mean,
            "behaviour_ratio_max_abs_dev": stats.behaviour_ratio_max_abs_dev,
            "behaviour_weight_capped_frac": stats.behaviour_weight_capped_frac}
