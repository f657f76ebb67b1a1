"""`AgentLoopManager`: splits a batch over `agent.num_workers` DiffusionAgentLoopWorker Ray actors and reassembles it.

Before splitting it fixes each row's `_group_index` (its position within its uid group over the WHOLE batch), so seeds
do not depend on the chunking. Chunks are cut at group boundaries and may be uneven; results are concatenated in the
original row order, prompt embeddings re-padded to one length across chunks, and failures of all chunks reported in
ONE `AgentLoopError` with global row numbers, carrying every chunk's succeeded rows merged into one batch
(`error.batch`, `error.succeeded_rows`). A worker whose actor dies (its node left the cluster) leaves the manager and
its chunk is re-run whole on a live worker: same rows, same `_group_index`, so the same seeds and the same samples
(its engine request ids get a `~rerunK` suffix, so they never collide with the lost worker's requests still running
on the replicas; the output keeps the rows' own request ids). In raise mode, rows that cannot share the output batch
are refused for the whole batch before any chunk is sent (see `rows.rows_that_cannot_share`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional, Union

import numpy as np

from omniroll.agent_loop.batch import DataBatch, to_object_array
from omniroll.models.base import is_sequence_embedding
from omniroll.agent_loop.rows import (as_config, base_sampling, failed_entries, group_indices, plan_rows, row_uids,
                                      rows_that_cannot_share)
from omniroll.agent_loop.worker import AgentLoopError, DiffusionAgentLoopWorker

_PER_CHUNK_META = ("metrics", "reward_extra_keys", "min_weight_version", "max_weight_version", "worker_seconds")


class AgentLoopManager:
    """config: OmniRollConfig / dict / DictConfig. rollout: a list of RolloutReplica handles, a `RolloutClient`, or
    a zero-argument factory returning a client (called here; the client is pickled into each worker, which gets its own
    routing state). reward_worker_handles: reward workers for streaming scoring (or None). worker_options: Ray actor
    options of every worker; placement(i): extra options of worker i (its placement-group bundle)."""

    def __init__(self, config: Any, rollout: Union[list, Any, Callable[[], Any]],
                 reward_worker_handles: Optional[list] = None, worker_options: Optional[dict] = None,
                 placement: Optional[Callable[[int], dict]] = None):
        import ray

        from omniroll.rollout.client import RolloutClient

        self.config = as_config(config)
        if isinstance(rollout, (list, tuple)):
            client = RolloutClient(list(rollout), timeout_s=self.config.timeout_s, max_retries=self.config.max_retries)
        elif isinstance(rollout, RolloutClient):
            client = rollout
        elif callable(rollout):
            client = rollout()
        else:
            raise TypeError(f"rollout must be replica handles, a RolloutClient or a factory, got {type(rollout)}")
        opts = {"num_cpus": 0, "max_concurrency": 1000, **(worker_options or {})}
        cls = ray.remote(DiffusionAgentLoopWorker)
        self.workers = [cls.options(**opts, **(placement(i) if placement else {})).remote(
            self.config, client, None, reward_worker_handles) for i in range(self.config.agent.num_workers)]
        self._calls = 0

    @staticmethod
    def prepare(batch: DataBatch) -> DataBatch:
        """Set `uid` (default: a hash of the prompt) and `_group_index` over the whole batch, before any split
        (unless the trainer gave `_rollout_seed_global_idx`, from which each worker derives it, see
        `group_index_column`)."""
        nt = batch.non_tensor_batch
        n = len(batch)
        uids = row_uids(nt, n)
        out = DataBatch(batch.batch, dict(nt), dict(batch.meta_info), n)
        out.non_tensor_batch["uid"] = to_object_array(uids)
        if "_group_index" not in nt and "_rollout_seed_global_idx" not in nt:
            out.non_tensor_batch["_group_index"] = to_object_array(group_indices(uids))
        return out

    def generate_sequences(self, batch: DataBatch) -> DataBatch:
        """Blocking version (for a synchronous trainer loop)."""
        return asyncio.run(self.generate_sequences_async(batch)) if not _in_loop() else _raise_in_loop()

    async def generate_sequences_async(self, batch: DataBatch) -> DataBatch:
        t0 = time.perf_counter()
        batch = self.prepare(batch)
        rows = plan_rows(self.config, batch)  # a bad batch field (global_steps, _group_index, ...) raises here
        if self.config.agent.on_failure == "raise":  # refuse the whole batch before any chunk generates anything
            validate = bool(batch.meta_info.get("validate", False))
            rejected = rows_that_cannot_share(base_sampling(self.config, batch.meta_info, validate),
                                              [f.get("sampling_params") for f in rows], validate)
            if rejected:
                raise AgentLoopError.from_rows(failed_entries(rows, rejected), len(rows),
                                               note=" before generation (nothing was generated)")
        chunks = batch.split(group_chunk_sizes(list(batch.non_tensor_batch["uid"]), len(self.workers)))
        offsets = np.cumsum([0] + [len(c) for c in chunks])
        # rotate the first worker per call, so concurrent small calls (one prompt group each) spread over workers
        start = self._calls % len(self.workers)
        self._calls += 1
        workers = self.workers[start:] + self.workers[:start]
        jobs = [(w, c, int(off)) for w, c, off in zip(workers, chunks, offsets) if len(c)]
        results = await asyncio.gather(*[self._run_chunk(w, c) for w, c, _ in jobs], return_exceptions=True)
        failed_rows: list[dict] = []
        kept: list[DataBatch] = []
        kept_rows: list[int] = []
        for (_, chunk, off), res in zip(jobs, results):
            if isinstance(res, BaseException):
                cause = getattr(res, "cause", None) or res
                if not isinstance(cause, AgentLoopError):
                    raise cause
                failed_rows += [{**f, "row": off + f["row"]} for f in cause.failed_rows]
                if cause.batch is not None and len(cause.batch):
                    kept.append(cause.batch)
                    kept_rows += [off + r for r in cause.succeeded_rows]
            else:
                kept.append(res)
                kept_rows += list(range(off, off + len(res)))
        if failed_rows:
            raise AgentLoopError.from_rows(sorted(failed_rows, key=lambda f: f["row"]), len(batch),
                                           batch=merge(kept) if kept else None, succeeded_rows=kept_rows)
        out = merge(list(results))
        out.meta_info["timing"] = batch_timing(out.meta_info["metrics"], time.perf_counter() - t0)
        return out

    async def _run_chunk(self, worker: Any, chunk: DataBatch) -> DataBatch:
        """One chunk on `worker`; if that worker's actor dies, the chunk again on a live one (see the module doc)."""
        from ray.exceptions import RayActorError

        rerun = 0
        while True:
            try:
                return await _await(worker.generate_sequences.remote(chunk))
            except RayActorError:
                self.drop_workers([worker])
                if not self.workers:
                    raise
                rerun += 1
                worker = self.workers[rerun % len(self.workers)]
                chunk = DataBatch(chunk.batch, chunk.non_tensor_batch, {**chunk.meta_info, "_rerun": rerun},
                                  len(chunk))

    def drop_workers(self, gone: list) -> None:
        """Send no more chunks to these workers (their actors are gone)."""
        self.workers = [w for w in self.workers if w not in gone]

    def shutdown(self) -> None:
        from omniroll.ray_nodes import kill_actors

        kill_actors(self.workers)
        self.workers = []


def group_chunk_sizes(uids: list[str], chunks: int) -> list[int]:
    """Sizes of `chunks` consecutive pieces, near-equal but cut only where the uid changes, so a prompt group stays on
    one agent-loop worker (whose client then keeps the whole group on one replica, where its encoding is cached)."""
    n = len(uids)
    cuts = [i for i in range(1, n) if uids[i] != uids[i - 1]]
    bounds = [0]
    for k in range(1, chunks):
        target = k * n / chunks
        best = min(cuts, key=lambda c: (abs(c - target), c)) if cuts else n
        bounds.append(max(best, bounds[-1]))
    bounds.append(n)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def merge(parts: list[DataBatch]) -> DataBatch:
    """Concatenate worker outputs in order: one embedding length, common reward keys, merged per-chunk meta."""
    lmax: dict[str, int] = {}
    for p in parts:
        for k in p.batch.keys():
            if is_sequence_embedding(k):
                lmax[k] = max(lmax.get(k, 0), int(p.batch[k].shape[1]))
    reward_keys = set.intersection(*[set(p.meta_info.get("reward_extra_keys") or []) for p in parts])
    all_reward_keys = set().union(*[set(p.meta_info.get("reward_extra_keys") or []) for p in parts])
    metrics, versions = [], []
    stripped = []
    for p in parts:
        for k, L in lmax.items():
            if k in p.batch.keys() and p.batch[k].shape[1] < L:
                _pad_field(p, k, L)
        metrics += p.meta_info.get("metrics", [])
        versions += [v for v in (p.meta_info.get("min_weight_version"), p.meta_info.get("max_weight_version"))
                     if v is not None]
        nt = {k: v for k, v in p.non_tensor_batch.items() if k not in all_reward_keys - reward_keys}
        meta = {k: v for k, v in p.meta_info.items() if k not in _PER_CHUNK_META}
        stripped.append(DataBatch(p.batch, nt, meta, len(p)))
    out = DataBatch.concat(stripped)
    out.meta_info.update(metrics=metrics, reward_extra_keys=sorted(reward_keys),
                         min_weight_version=min(versions) if versions else None,
                         max_weight_version=max(versions) if versions else None)
    return out


def _pad_field(p: DataBatch, key: str, length: int) -> None:
    import torch

    t, m = p.batch[key], p.batch[f"{key}_mask"]
    extra = length - t.shape[1]
    p.batch = p.batch.exclude(key, f"{key}_mask")
    p.batch[key] = torch.cat([t, t.new_zeros((t.shape[0], extra) + tuple(t.shape[2:]))], dim=1)
    p.batch[f"{key}_mask"] = torch.cat([m, m.new_zeros((m.shape[0], extra))], dim=1)


def batch_timing(metrics: list[dict], wall: float) -> dict:
    """A batch's `meta_info["timing"]`: its wall seconds and its rows' generate / score times (min, mean, max)."""
    gen = [m.get("generate_sequences", 0.0) for m in metrics] or [0.0]
    score = [m.get("compute_score", 0.0) for m in metrics] or [0.0]
    slow = int(np.argmax(gen))
    return {"wall_seconds": wall, "generate_sequences/min": min(gen), "generate_sequences/max": max(gen),
            "generate_sequences/mean": float(np.mean(gen)), "compute_score/mean": float(np.mean(score)),
            "compute_score/max": max(score), "slowest_request_id": metrics[slow].get("request_id") if metrics else None}


async def _await(ref: Any) -> Any:
    return await ref


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _raise_in_loop():
    raise RuntimeError("AgentLoopManager.generate_sequences was called inside an event loop; "
                       "await generate_sequences_async instead")
