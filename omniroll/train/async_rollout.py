"""`RolloutPipeline`: the rollouts of coming training steps, run on a background event loop while the trainer thread
trains (the asynchronous trainer, `trainer.max_staleness` >= 1).

    pipe = RolloutPipeline(generate)       # generate(step) -> awaitable DataBatch (the agent-loop manager's)
    pipe.submit(step)                      # queued; batches generate one at a time, in submission order
    batch = pipe.take(step)                # blocks until that batch is back
    with pipe.held():                      # no batch starts inside; entered once the running one has finished
        sender.send(...)                   # (a weight sync that waits for in-flight samples)
    pipe.discard()                         # Ctrl-C / close: cancel what is queued or running; returns the row count

Busy intervals (time.time()) of every batch are kept so the trainer can measure `overlap_frac`: the share of a
step's wall time when a rollout and the trainer were both busy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from typing import Any, Awaitable, Callable, Iterator, Optional


class RolloutPipeline:
    def __init__(self, generate: Callable[[int], Awaitable[Any]], rows_per_batch: int = 0):
        self._generate = generate
        self.rows_per_batch = int(rows_per_batch)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omniroll-rollout", daemon=True)
        self._thread.start()
        self._futures: dict[int, cf.Future] = {}
        self.spans: dict[int, list] = {}  # step -> [start, end or None] (time.time()) of every started batch
        self._spans_lock = threading.Lock()  # the loop thread adds spans, the trainer thread reads and prunes them
        self._call(self._init_primitives())

    async def _init_primitives(self) -> None:
        self._lock = asyncio.Lock()  # one batch generates at a time, FIFO
        self._gate = asyncio.Event()  # closed while a waiting weight sync runs
        self._gate.set()
        self._idle = asyncio.Event()  # set while no batch generates
        self._idle.set()

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ batches
    def submit(self, step: int) -> None:
        if step not in self._futures:
            self._futures[step] = asyncio.run_coroutine_threadsafe(self._run(step), self._loop)

    def submitted(self, step: int) -> bool:
        return step in self._futures

    def take(self, step: int) -> Any:
        """The batch of `step` (submitted now if it was not), once generated; its error if it failed."""
        self.submit(step)
        try:
            return self._futures[step].result()
        finally:
            if self._futures[step].done():
                del self._futures[step]

    async def _run(self, step: int) -> Any:
        async with self._lock:
            await self._gate.wait()
            self._idle.clear()
            span = [time.time(), None]
            with self._spans_lock:
                self.spans[step] = span
            try:
                return await self._generate(step)
            finally:
                span[1] = time.time()
                self._idle.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No batch starts inside the block, which is entered once the running batch (if any) has finished."""
        self._call(self._close_gate())
        try:
            yield
        finally:
            self._loop.call_soon_threadsafe(self._gate.set)

    async def _close_gate(self) -> None:
        self._gate.clear()
        await self._idle.wait()

    def in_flight(self) -> list[int]:
        return sorted(self._futures)

    def discard(self) -> int:
        """Cancel every queued or running batch and wait until each has ended (also one cancelled before it started,
        so none is left pending on the loop); returns how many sample rows were discarded."""
        steps = list(self._futures)
        for f in self._futures.values():
            f.cancel()
        with contextlib.suppress(BaseException):
            asyncio.run_coroutine_threadsafe(self._cancel_tasks(), self._loop).result(timeout=30)
        self._futures.clear()
        return len(steps) * self.rows_per_batch

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        self.discard()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    # ------------------------------------------------------------------ overlap
    def busy(self, since: float, until: float) -> list[tuple[float, float]]:
        """Rollout busy intervals clipped to [since, until] (a running batch counts up to `until`)."""
        out = []
        with self._spans_lock:
            spans = [list(s) for s in self.spans.values()]
        for a, b in spans:
            b = until if b is None else b
            a, b = max(a, since), min(b, until)
            if b > a:
                out.append((a, b))
        return out

    def span(self, step: int) -> Optional[tuple[float, float]]:
        """(start, end) of `step`'s generation once it has finished, else None."""
        with self._spans_lock:
            s = self.spans.get(step)
            return (s[0], s[1]) if s is not None and s[1] is not None else None

    def forget_before(self, t: float) -> None:
        with self._spans_lock:
            for k in [k for k, s in self.spans.items() if s[1] is not None and s[1] <= t]:
                del self.spans[k]


def regenerate_in_flight(pipeline: RolloutPipeline, step_done: int, max_staleness: int, last_step: int,
                         sync: Callable[[int], None], has_version: Callable[[int], bool], current_version: int,
                         log: Callable[[str], None]) -> None:
    """On resume: submit the batches that were in flight at the checkpoint as the straight run generated them (batch b
    with version b-1-K: exact with partial_rollout false), syncing each version first, then the checkpoint's own
    version. A version the checkpoint does not keep (written with a smaller K) is replaced by the checkpoint's, and
    said."""
    K, s, version = max_staleness, step_done, current_version
    for b in range(s + 1, min(s + K, last_step) + 1):
        v = max(0, b - 1 - K)
        if not has_version(v):
            log(f"resume: the checkpoint keeps no weights of version {v} (written with a smaller max_staleness): "
                f"batch {b} is generated with version {s}, not as the straight run did")
            v = s
        if v > version:
            sync(v)
            version = v
        pipeline.submit(b)
    if s > version:
        sync(s)


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    def union(xs):
        out: list[list[float]] = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    ua, ub = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(hi - lo, 0.0)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


__all__ = ["RolloutPipeline", "overlap_seconds", "regenerate_in_flight"]
