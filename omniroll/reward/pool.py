"""`RewardWorkerPool`: client-side least-loaded routing over reward workers (Ray actor handles or plain objects),
with worker health: a dead worker leaves the pool and its samples are re-scored on a live one."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence, Union

from omniroll.reward.manager import RewardConfig
from omniroll.reward.types import RewardResult, RewardSample
from omniroll.reward.worker import RewardLoopWorker


class RewardPoolError(RuntimeError):
    """A sample could not be scored by any worker: every worker left the pool, or the sample lost `max_rescores + 1`
    workers in a row. Names the sample and what happened on each attempt."""


def _is_actor(handle: Any) -> bool:
    return hasattr(getattr(handle, "compute_score", None), "remote")


def _worker_fault(error: BaseException) -> Optional[str]:
    """"dead" (the actor died: it leaves the pool), "unavailable" (unreachable for now: re-score elsewhere, keep it),
    or None (not the worker's fault: the error reaches the caller as is)."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:  # in-process workers only
        return None
    if isinstance(error, RayActorError):
        return "dead"
    if isinstance(error, ActorUnavailableError):
        return "unavailable"
    return None


class RewardWorkerPool:
    """Send each sample to the live worker with the fewest in-flight requests *from this pool*.

    The count is tracked client-side (no round trip per sample); ties go round-robin, starting after the worker
    picked last, so an idle pool spreads consecutive samples instead of always choosing the first. Works with Ray
    actor handles (`handle.compute_score.remote(sample)` is awaited) and with in-process `RewardLoopWorker`s. Use the
    pool from one event loop.

    Health: a call that fails because its actor died (`RayActorError`) removes that worker from the pool for good,
    and the sample (with every other sample that was in flight there) is re-scored on a live worker; an unavailable
    actor (`ActorUnavailableError`) stays in the pool but the sample goes elsewhere. A sample is re-scored at most
    `max_rescores` times; when no worker is left, `score` raises `RewardPoolError` saying so. Errors that are not the
    worker's (a bad sample) are raised as they are, never retried.
    """

    def __init__(self, handles: Sequence[Any], max_rescores: int = 2):
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
        self._in_flight = [0] * len(handles)
        self._sent = [0] * len(handles)
        self._dead: dict[int, str] = {}  # worker index -> why it left the pool
        self._rescored = 0
        self._next = 0  # round-robin cursor for ties

    def __len__(self) -> int:
        return len(self.handles)

    def _pick(self, sample_id: str, attempts: list[str]) -> int:
        n = len(self.handles)
        live = [i for i in range(n) if i not in self._dead]
        if not live:
            why = "; ".join(f"worker {i}: {e}" for i, e in sorted(self._dead.items()))
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
        """Score one sample on the least-loaded live worker (re-scored elsewhere if that worker dies)."""
        attempts: list[str] = []
        for attempt in range(self.max_rescores + 1):
            i = self._pick(sample.sample_id, attempts)
            self._in_flight[i] += 1
            self._sent[i] += 1
            try:
                handle = self.handles[i]
                if _is_actor(handle):
                    return await handle.compute_score.remote(sample)
                return await handle.compute_score(sample)
            except Exception as e:  # noqa: BLE001 - classified: the worker's fault is handled, the rest re-raised
                fault = _worker_fault(e)
                if fault is None:
                    raise
                reason = f"{type(e).__name__}: {_first_line(e)}"
                if fault == "dead":
                    self._dead.setdefault(i, reason)
                attempts.append(f"worker {i} {fault} ({reason})")
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
        return {"in_flight": self.load(), "sent": self.sent(), "dead": sorted(self._dead),
                "live": len(self.handles) - len(self._dead), "rescored": self._rescored}


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else repr(e)


def create_reward_workers(config: Union[dict, list, RewardConfig], num_workers: int = 1, *,
                          max_concurrency: int = 1000, num_cpus: float = 0.0,
                          runtime_env: Optional[dict] = None, placement: Optional[Callable[[int], dict]] = None,
                          **options) -> list[Any]:
    """Start `num_workers` `RewardLoopWorker` Ray actors (async, `max_concurrency` concurrent calls each).
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
    opts = dict(max_concurrency=max_concurrency, num_cpus=num_cpus, **options)
    if runtime_env is not None:
        opts["runtime_env"] = runtime_env
    remote_cls = ray.remote(RewardLoopWorker)
    if not options.get("resources"):
        opts.pop("resources", None)
    return [remote_cls.options(**opts, **(placement(i) if placement else {})).remote(cfg, worker_id=i)
            for i in range(num_workers)]
