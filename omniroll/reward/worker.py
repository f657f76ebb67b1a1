"""`RewardLoopWorker`: per-sample scoring entry point that micro-batches concurrent callers.

Use it in-process (`await worker.compute_score(sample)`) or as an async Ray actor::

    Remote = ray.remote(RewardLoopWorker)            # or create_reward_workers(...) in omniroll.reward.pool
    w = Remote.options(max_concurrency=1000).remote(config, worker_id=0)
    result = await w.compute_score.remote(sample)

Samples that arrive within `max_wait_ms` of the first queued one, up to `max_batch_size`, go to the
`RewardManager` as one batch; each caller gets its own `RewardResult`. A full batch is sent at once. All state lives on
one event loop (the actor's, or the caller's in-process), so no locks are needed.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Optional, Union

from omniroll.reward.manager import RewardConfig, RewardManager
from omniroll.reward.types import RewardResult, RewardSample


class RewardLoopWorker:
    """Micro-batching reward worker. `max_batch_size` / `max_wait_ms` override the config's values when given."""

    def __init__(self, config: Union[dict, list, RewardConfig], worker_id: int = 0,
                 max_batch_size: Optional[int] = None, max_wait_ms: Optional[float] = None):
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
