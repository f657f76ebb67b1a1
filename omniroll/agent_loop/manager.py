"""`AgentLoopManager`: splits a batch over `agent.num_workers` DiffusionAgentLoopWorker Ray actors and reassembles it.

Before splitting it fixes each row's `_group_index` (its position within its uid group over the WHOLE batch), so seeds
do not depend on the chunking, and plans the batch once (`rows.plan_batch`: every row's seed, request id and sampling;
in raise mode rows that cannot share the output batch are refused for the whole batch before any chunk is sent);
each worker gets its chunk with its part of the plan. Chunks are cut at group boundaries and may be uneven; results
are concatenated in the original row order, prompt embeddings re-padded to one length across chunks, and failures of
all chunks reported in ONE `AgentLoopError` with global row numbers, carrying every chunk's succeeded rows merged into
one batch (`error.batch`, `error.succeeded_rows`).

Lost workers: Ray restarts a worker whose process or node is lost (`omniroll.ray_nodes.RESTARTED`: a worker holds no
state). Its chunk is re-run whole on a usable worker, or on it once it answers again (at most `restart_timeout_s`):
same rows, same plan, so the same seeds and the same samples (its engine request ids get a `~rerunK` suffix, so they
never collide with the lost worker's requests still running on the replicas; the output keeps the rows' own ids).
"""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any, Callable, Optional, Union

import numpy as np

from omniroll.agent_loop.batch import DataBatch, to_object_array
from omniroll.models.base import is_sequence_embedding
from omniroll.agent_loop.rows import RowPlan, as_config, group_indices, plan_batch, row_uids
from omniroll.agent_loop.worker import AgentLoopError, DiffusionAgentLoopWorker, refuse_unshareable
from omniroll.ray_nodes import RESTARTED, ActorHealth, actor_fault

_PER_CHUNK_META = ("metrics", "reward_extra_keys", "min_weight_version", "max_weight_version", "worker_seconds")


class RestartableAgentLoopWorker(DiffusionAgentLoopWorker):
    """The manager's worker: a `DiffusionAgentLoopWorker` whose rollout client and reward-worker handles come as one
    pickled `handles` blob. Small bytes travel inline in the actor's creation task, which Ray replays when it restarts
    the worker; actor handles passed as they are would be kept in the object store, where a restart may not find them
    (Ray logs an error line about it for every such actor, ray#53727). The handles' actors live as long as the
    manager's own handles."""

    def __init__(self, config: Any, handles: bytes):
        client, reward_worker_handles = pickle.loads(handles)
        super().__init__(config, client, None, reward_worker_handles)


class AgentLoopManager:
    """config: OmniRollConfig / dict / DictConfig. rollout: a list of RolloutReplica handles, a `RolloutClient`, or
    a zero-argument factory returning a client (called here; the client is pickled into each worker, which gets its own
    routing state). reward_worker_handles: reward workers for streaming scoring (or None). worker_options: Ray actor
    options of every worker; placement(i): extra options of worker i (its placement-group bundle). restart_timeout_s:
    how long a chunk waits for a lost worker to come back when no other worker can take it."""

    def __init__(self, config: Any, rollout: Union[list, Any, Callable[[], Any]],
                 reward_worker_handles: Optional[list] = None, worker_options: Optional[dict] = None,
                 placement: Optional[Callable[[int], dict]] = None, restart_timeout_s: float = 300.0):
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
        # restartable; the actor handles they need travel as bytes inside their creation task (see
        # RestartableAgentLoopWorker), which is what Ray replays on a restart
        opts = {"num_cpus": 0, "max_concurrency": 1000, **RESTARTED, **(worker_options or {})}
        cls = ray.remote(RestartableAgentLoopWorker)
        handles = pickle.dumps((client, reward_worker_handles))
        self.workers = [cls.options(**opts, **(placement(i) if placement else {})).remote(self.config, handles)
                        for i in range(self.config.agent.num_workers)]
        self.health = ActorHealth(self.workers, restart_timeout_s)
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
        plan = plan_batch(self.config, batch)  # a bad batch field (global_steps, _group_index, ...) raises here
        refuse_unshareable(plan, self.config.agent.on_failure)  # before any chunk generates anything
        workers = await self._usable()
        chunks = batch.split(group_chunk_sizes(list(batch.non_tensor_batch["uid"]), len(workers)))
        offsets = np.cumsum([0] + [len(c) for c in chunks])
        # rotate the first worker per call, so concurrent small calls (one prompt group each) spread over workers
        start = self._calls % len(workers)
        self._calls += 1
        workers = workers[start:] + workers[:start]
        jobs = [(w, c, int(off)) for w, c, off in zip(workers, chunks, offsets) if len(c)]
        results = await asyncio.gather(*[self._run_chunk(w, c, plan.part(off, off + len(c))) for w, c, off in jobs],
                                       return_exceptions=True)
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

    async def _run_chunk(self, worker: int, chunk: DataBatch, plan: RowPlan) -> DataBatch:
        """One chunk on worker `worker`; if that worker is lost, the chunk again on a usable one (module doc)."""
        rerun = 0
        while True:
            try:
                return await _await(self.workers[worker].generate_planned.remote(chunk, plan, rerun))
            except Exception as e:  # noqa: BLE001 - classified: a lost worker re-runs the chunk, the rest re-raised
                if actor_fault(e) is None:
                    raise
                self.health.lost(worker, e)
                usable = await self._usable()
                rerun += 1
                worker = usable[rerun % len(usable)]

    async def _usable(self) -> list[int]:
        """The workers that take chunks now (waiting for a restarting one when there is none); raises when every
        worker is gone for good."""
        usable = await self.health.wait_usable()
        if not usable:
            why = "; ".join(f"worker {i}: {e}" for i, e in sorted(self.health.dead.items()))
            raise RuntimeError(f"every agent-loop worker ({len(self.workers)} of {len(self.workers)}) is gone: {why}")
        return usable

    def shutdown(self) -> None:
        from omniroll.ray_nodes import kill_actors

        self.health.close()
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
