"""`RewardWorkerPool`: client-side least-loaded routing over reward workers (Ray actor handles or plain objects)."""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence, Union

from omniroll.reward.manager import RewardConfig
from omniroll.reward.types import RewardResult, RewardSample
from omniroll.reward.worker import RewardLoopWorker


def _is_actor(handle: Any) -> bool:
    return hasattr(getattr(handle, "compute_score", None), "remote")


class RewardWorkerPool:
    """Send each sample to the worker with the fewest in-flight requests *from this pool*.

    The count is tracked client-side (no round trip per sample); ties go round-robin, starting after the worker
    picked last, so an idle pool spreads consecutive samples instead of always choosing the first. Works with Ray
    actor handles (`handle.compute_score.remote(sample)` is awaited) and with in-process `RewardLoopWorker`s. Use the
    pool from one event loop.
    """

    def __init__(self, handles: Sequence[Any]):
        handles = list(handles)
        if not handles:
            raise ValueError("RewardWorkerPool needs at least one worker handle, got 0")
        for i, h in enumerate(handles):
            if not hasattr(h, "compute_score"):
                raise TypeError(f"handles[{i}] ({type(h).__name__}) has no compute_score method")
        self.handles = handles
        self._in_flight = [0] * len(handles)
        self._sent = [0] * len(handles)
        self._next = 0  # round-robin cursor for ties

    def __len__(self) -> int:
        return len(self.handles)

    def _pick(self) -> int:
        n = len(self.handles)
        least = min(self._in_flight)
        for k in range(n):
            i = (self._next + k) % n
            if self._in_flight[i] == least:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable")

    async def score(self, sample: RewardSample) -> RewardResult:
        """Score one sample on the least-loaded worker."""
        i = self._pick()
        self._in_flight[i] += 1
        self._sent[i] += 1
        try:
            handle = self.handles[i]
            if _is_actor(handle):
                return await handle.compute_score.remote(sample)
            return await handle.compute_score(sample)
        finally:
            self._in_flight[i] -= 1

    async def score_many(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self.score(s) for s in samples)))

    def load(self) -> list[int]:
        """In-flight requests per worker, as this pool counts them."""
        return list(self._in_flight)

    def sent(self) -> list[int]:
        """Requests sent per worker since the pool was made."""
        return list(self._sent)


def create_reward_workers(config: Union[dict, list, RewardConfig], num_workers: int = 1, *,
                          max_concurrency: int = 1000, num_cpus: float = 0.0,
                          runtime_env: Optional[dict] = None, **options) -> list[Any]:
    """Start `num_workers` `RewardLoopWorker` Ray actors (async, `max_concurrency` concurrent calls each).

    The config is validated here first, so a bad config fails in the caller, not inside an actor.
    """
    import ray

    if not isinstance(num_workers, int) or not 1 <= num_workers <= 1024:
        raise ValueError(f"num_workers must be an int in [1, 1024], got {num_workers!r}")
    if not isinstance(max_concurrency, int) or not 1 <= max_concurrency <= 100_000:
        raise ValueError(f"max_concurrency must be an int in [1, 100000], got {max_concurrency!r}")
    cfg = RewardConfig.from_any(config)
    opts = dict(max_concurrency=max_concurrency, num_cpus=num_cpus, **options)
    if runtime_env is not None:
        opts["runtime_env"] = runtime_env
    remote_cls = ray.remote(RewardLoopWorker)
    return [remote_cls.options(**opts).remote(cfg, worker_id=i) for i in range(num_workers)]
