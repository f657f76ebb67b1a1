"""Reward workers and the pool that routes samples to them.

`RewardLoopWorker`: per-sample scoring entry point that micro-batches concurrent callers.

Use it in-process (`await worker.compute_score(sample)`) or as an async Ray actor::

    Remote = ray.remote(RewardLoopWorker)            # or create_reward_workers(...), below
    w = Remote.options(max_concurrency=1000).remote(config, worker_id=0)
    result = await w.compute_score.remote(sample)

Samples that arrive within `max_wait_ms` of the first queued one, up to `max_batch_size`, go to the
`RewardManager` as one batch; each caller gets its own `RewardResult`. A full batch is sent at once. All state lives on
one event loop (the actor's, or the caller's in-process), so no locks are needed.

`RewardWorkerPool`: client-side least-loaded routing over reward workers (Ray actor handles or plain objects), with
worker health: the samples of a lost worker are re-scored on a usable one (Ray restarts a worker whose node left; a
worker gone for good leaves the pool). `create_reward_workers` starts the workers as restartable Ray actors.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable, Optional, Sequence, Union

from omniroll.library_warnings import silence_library_warnings
from omniroll.ray_nodes import RESTARTED, ActorHealth, actor_fault
from omniroll.reward.manager import RewardConfig, RewardManager
from omniroll.reward.scorers import RewardResult, RewardSample


class RewardLoopWorker:
    """Micro-batching reward worker. `max_batch_size` / `max_wait_ms` override the config's values when given."""

    def __init__(self, config: Union[dict, list, RewardConfig], worker_id: int = 0,
                 max_batch_size: Optional[int] = None, max_wait_ms: Optional[float] = None):
        silence_library_warnings()  # this actor's process: third-party warnings its user cannot act on
        cfg = RewardConfig.from_any(config)
        updates = {}
        if max_batch_size is not None:
            updates["max_batch_size"] = max_batch_size
        if max_wait_ms is not None:
            updates["max_wait_ms"] = max_wait_ms
        if updates:  # re-validate so the overrides get the same range checks
            cfg = RewardConfig.model_validate({**cfg.model_dump(), **updates})
        if not isinstance(worker_id, int) or isinstance(worker_id, bool) or worker_id < 0:
            raise ValueError(f"worker_id must be an int >= 0, got {worker_id!r}")
        self.config = cfg
        self.worker_id = worker_id
        self.manager = RewardManager(cfg)
        self.max_batch_size = cfg.max_batch_size
        self.max_wait_s = cfg.max_wait_ms / 1000.0
        self._queue: list[tuple[RewardSample, asyncio.Future]] = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._tasks: set[asyncio.Task] = set()
        self._in_flight = 0
        self._batches = 0
        self._samples = 0
        self._batch_sizes: collections.deque[int] = collections.deque(maxlen=256)
        self._status_counts = {"ok": 0, "flagged": 0, "failed": 0}
        self._manager_errors = 0
        self._busy_s = 0.0

    # ------------------------------------------------------------------------------------------------ public
    async def compute_score(self, sample: RewardSample) -> RewardResult:
        """Score one sample (batched with whatever else arrives within `max_wait_ms`)."""
        if not isinstance(sample, RewardSample):
            raise TypeError(f"compute_score expects a RewardSample, got {type(sample).__name__}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._in_flight += 1
        try:
            self._queue.append((sample, fut))
            if len(self._queue) >= self.max_batch_size:
                self._flush()
            elif self._timer is None:
                self._timer = loop.call_later(self.max_wait_s, self._flush)
            return await fut
        finally:
            self._in_flight -= 1

    async def compute_scores(self, samples: list[RewardSample]) -> list[RewardResult]:
        """Score several samples (each goes through the micro-batcher, so they may be split or merged)."""
        return list(await asyncio.gather(*(self.compute_score(s) for s in samples)))

    def load(self) -> int:
        """Samples accepted and not yet answered (queued + being scored)."""
        return self._in_flight

    def stats(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "in_flight": self._in_flight,
            "queued": len(self._queue),
            "batches": self._batches,
            "samples": self._samples,
            "batch_sizes": list(self._batch_sizes),
            "status_counts": dict(self._status_counts),
            "manager_errors": self._manager_errors,
            "busy_s": self._busy_s,
            "functions": self.manager.names,
            "max_batch_size": self.max_batch_size,
            "max_wait_ms": self.max_wait_s * 1000.0,
        }

    def ping(self) -> int:
        return self.worker_id

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.manager.aclose()

    # ----------------------------------------------------------------------------------------------- batching
    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size:]
            batch = [(s, f) for s, f in batch if not f.done()]  # callers cancelled while queued
            if batch:
                task = asyncio.get_running_loop().create_task(self._run(batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if len(self._queue) < self.max_batch_size:
                break
        if self._queue:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._flush)

    async def _run(self, batch: list[tuple[RewardSample, asyncio.Future]]) -> None:
        self._batches += 1
        self._samples += len(batch)
        self._batch_sizes.append(len(batch))
        t0 = time.perf_counter()
        try:
            results = await self.manager.score([s for s, _ in batch])
        except BaseException as e:  # a bug, not a scorer failure: every caller sees the exception, nobody gets 0
            self._manager_errors += 1
            for _, fut in batch:
                if not fut.done():
                    fut.cancel() if isinstance(e, asyncio.CancelledError) else fut.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        finally:
            self._busy_s += time.perf_counter() - t0
        for (_, fut), result in zip(batch, results):
            self._status_counts[result.status] += 1
            if not fut.done():
                fut.set_result(result)


class RewardPoolError(RuntimeError):
    """A sample could not be scored by any worker: every worker left the pool, or the sample lost `max_rescores + 1`
    workers in a row. Names the sample and what happened on each attempt."""


def _is_actor(handle: Any) -> bool:
    return hasattr(getattr(handle, "compute_score", None), "remote")


class RewardWorkerPool:
    """Send each sample to the usable worker with the fewest in-flight requests *from this pool*.

    The count is tracked client-side (no round trip per sample); ties go round-robin, starting after the worker
    picked last, so an idle pool spreads consecutive samples instead of always choosing the first. Works with Ray
    actor handles (`handle.compute_score.remote(sample)` is awaited) and with in-process `RewardLoopWorker`s. Use the
    pool from one event loop.

    Health (`omniroll.ray_nodes.ActorHealth`): a worker whose node left is restarted by Ray (`create_reward_workers`
    starts them restartable); the samples it was scoring are re-scored on another usable worker, or on it once it
    answers again (a sample waits for that at most `restart_timeout_s`). A worker killed for good, or not back within
    `restart_timeout_s`, leaves the pool. A sample is re-scored at most `max_rescores` times; when no worker is left,
    `score` raises `RewardPoolError` saying so. Errors that are not the worker's (a bad sample) are raised as they
    are, never retried. A re-scored sample gets the same score (a reward is a function of the sample).
    """

    def __init__(self, handles: Sequence[Any], max_rescores: int = 2, restart_timeout_s: float = 300.0):
        handles = list(handles)
        if not handles:
            raise ValueError("RewardWorkerPool needs at least one worker handle, got 0")
        for i, h in enumerate(handles):
            if not hasattr(h, "compute_score"):
                raise TypeError(f"handles[{i}] ({type(h).__name__}) has no compute_score method")
        if not isinstance(max_rescores, int) or isinstance(max_rescores, bool) or not 0 <= max_rescores <= 100:
            raise ValueError(f"max_rescores must be an int in [0, 100], got {max_rescores!r}")
        self.handles = handles
        self.max_rescores = max_rescores
        self.health = ActorHealth(handles, restart_timeout_s)
        self._in_flight = [0] * len(handles)
        self._sent = [0] * len(handles)
        self._rescored = 0
        self._next = 0  # round-robin cursor for ties

    def __len__(self) -> int:
        return len(self.handles)

    async def _pick(self, sample_id: str, attempts: list[str]) -> int:
        n = len(self.handles)
        live = await self.health.wait_usable()
        if not live:
            why = "; ".join(f"worker {i}: {e}" for i, e in sorted(self.health.dead.items()))
            tried = f" (this sample: {'; '.join(attempts)})" if attempts else ""
            raise RewardPoolError(f"sample {sample_id!r} cannot be scored: every reward worker ({n} of {n}) left the "
                                  f"pool: {why}{tried}")
        least = min(self._in_flight[i] for i in live)
        for k in range(n):
            i = (self._next + k) % n
            if i in live and self._in_flight[i] == least:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable")

    async def score(self, sample: RewardSample) -> RewardResult:
        """Score one sample on the least-loaded usable worker (re-scored elsewhere if that worker is lost)."""
        attempts: list[str] = []
        for attempt in range(self.max_rescores + 1):
            i = await self._pick(sample.sample_id, attempts)
            self._in_flight[i] += 1
            self._sent[i] += 1
            try:
                handle = self.handles[i]
                if _is_actor(handle):
                    return await handle.compute_score.remote(sample)
                return await handle.compute_score(sample)
            except Exception as e:  # noqa: BLE001 - classified: the worker's fault is handled, the rest re-raised
                fault = actor_fault(e)
                if fault is None:
                    raise
                attempts.append(f"worker {i} {fault} ({self.health.lost(i, e)})")
                if attempt < self.max_rescores:
                    self._rescored += 1
            finally:
                self._in_flight[i] -= 1
        raise RewardPoolError(f"sample {sample.sample_id!r} lost {len(attempts)} reward workers in a row "
                              f"(max_rescores={self.max_rescores}): {'; '.join(attempts)}")

    async def score_many(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self.score(s) for s in samples)))

    def load(self) -> list[int]:
        """In-flight requests per worker, as this pool counts them."""
        return list(self._in_flight)

    def sent(self) -> list[int]:
        """Requests sent per worker since the pool was made (re-scored samples count on each worker tried)."""
        return list(self._sent)

    def stats(self) -> dict:
        return {"in_flight": self.load(), "sent": self.sent(), "dead": sorted(self.health.dead),
                "restarting": self.health.restarting(), "live": len(self.health.usable()),
                "rescored": self._rescored}


def create_reward_workers(config: Union[dict, list, RewardConfig], num_workers: int = 1, *,
                          max_concurrency: int = 1000, num_cpus: float = 0.0,
                          runtime_env: Optional[dict] = None, placement: Optional[Callable[[int], dict]] = None,
                          **options) -> list[Any]:
    """Start `num_workers` `RewardLoopWorker` Ray actors (async, `max_concurrency` concurrent calls each), which Ray
    restarts when their process or node is lost (`omniroll.ray_nodes.RESTARTED`; they hold no state).
    `placement(i)`: extra actor options for worker i (its placement-group bundle; see `omniroll.rollout.ray_cluster`);
    `options`: any other Ray actor option (e.g. `resources`).

    The config is validated here first, so a bad config fails in the caller, not inside an actor.
    """
    import ray

    if not isinstance(num_workers, int) or not 1 <= num_workers <= 1024:
        raise ValueError(f"num_workers must be an int in [1, 1024], got {num_workers!r}")
    if not isinstance(max_concurrency, int) or not 1 <= max_concurrency <= 100_000:
        raise ValueError(f"max_concurrency must be an int in [1, 100000], got {max_concurrency!r}")
    cfg = RewardConfig.from_any(config)
    opts = {"max_concurrency": max_concurrency, "num_cpus": num_cpus, **RESTARTED, **options}
    if runtime_env is not None:
        opts["runtime_env"] = runtime_env
    remote_cls = ray.remote(RewardLoopWorker)
    if not options.get("resources"):
        opts.pop("resources", None)
    return [remote_cls.options(**opts, **(placement(i) if placement else {})).remote(cfg, worker_id=i)
            for i in range(num_workers)]
