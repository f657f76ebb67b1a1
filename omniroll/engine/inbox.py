"""`Inbox`: what caller threads hand to the engine thread: new requests and control calls, and the ids of requests in
flight.

Callers `add` requests (ids must be unique among queued and running requests, since `abort(id)` names one) and `call`
functions to run between two steps; the loop thread `take`s everything at once, waiting while there is nothing to
do, and `run`s the calls. After `close(reason)` every add raises EngineShutdownError and `drain` fails what was left.
The inbox owns its lock; nothing else reads its queues.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from omniroll.engine.errors import EngineShutdownError, RequestError
from omniroll.engine.request import RequestState


Control = tuple[Callable[[], Any], concurrent.futures.Future]


class Inbox:
    def __init__(self):
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)  # the loop thread waits on it
        self._settled = threading.Condition(self._lock)  # callers of `wait_until` wait on it
        self._requests: deque[RequestState] = deque()
        self._controls: deque[Control] = deque()
        self._live_ids: set[str] = set()  # ids queued here or running in the engine, until `release`
        self.closed: Optional[str] = None  # why every add is refused: "shut down" or "shut down (its loop died: ..)"

    def __len__(self) -> int:
        """Requests not yet taken by the loop."""
        with self._lock:
            return len(self._requests)

    def check_open(self, op: str) -> None:
        if self.closed is not None:
            raise EngineShutdownError(f"{op}: the engine is {self.closed}; create a new engine")

    def add(self, states: list[RequestState]) -> None:
        """Queue these requests, all or none (RequestError for an id already in flight or repeated)."""
        with self._lock:
            self.check_open("generate")
            seen: set[str] = set()
            for rid in (s.request_id for s in states):
                if rid in self._live_ids or rid in seen:
                    raise RequestError(rid, "request_id is already in flight in this engine; request ids must be "
                                            "unique among queued and running requests")
                seen.add(rid)
            self._live_ids |= seen
            self._requests.extend(states)
            self._wakeup.notify()

    def call(self, fn: Callable[[], Any], timeout_s: float, op: str) -> Any:
        """Queue `fn` for the loop thread and wait for its result (or its error). TimeoutError naming `op` after
        `timeout_s`; a call that had not started by then never runs, and one that had runs to its end (a model
        change cannot stop halfway): the error says which."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self.check_open(op)
            self._controls.append((fn, future))
            self._wakeup.notify()
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done() and not future.cancelled():
                raise  # fn itself raised a TimeoutError
            if future.cancel():
                raise TimeoutError(f"{op} did not start within {timeout_s:g}s (the engine thread was busy with a "
                                   f"step or an earlier call): it will never run, nothing changed") from None
            raise TimeoutError(f"{op} did not finish within {timeout_s:g}s and is still running on the engine thread: "
                               f"it cannot be stopped halfway and will complete (or fail) after this error; check "
                               f"the engine's stats() before calling it again") from None

    @staticmethod
    def run(control: Control) -> None:
        """Run one control call (on the loop thread), delivering its result or error to its caller."""
        fn, future = control
        if not future.set_running_or_notify_cancel():
            return  # its caller timed out before it started: it never runs
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            future.set_exception(e)

    def release(self, request_id: str) -> None:
        """The request is done: its id may be used again."""
        with self._lock:
            self._live_ids.discard(request_id)

    def remove(self, request_id: str) -> Optional[RequestState]:
        """Take one queued request out (None when it is not queued here)."""
        with self._lock:
            for s in self._requests:
                if s.request_id == request_id:
                    self._requests.remove(s)
                    return s
        return None

    def take(self, busy: Callable[[], bool], wait_s: Callable[[], Optional[float]] = lambda: None
             ) -> Optional[tuple[list[RequestState], list[Control]]]:
        """Everything queued, waiting first while nothing is queued and not `busy()` (each wait at most `wait_s()`
        seconds, None: until woken); None once closed."""
        with self._lock:
            while self.closed is None and not self._controls and not self._requests and not busy():
                self._wakeup.wait(wait_s())
            if self.closed is not None:
                return None
            return self._take_locked()

    def take_requests(self) -> list[RequestState]:
        """Every queued request, at once (for the callers that fail or abort them)."""
        with self._lock:
            states = list(self._requests)
            self._requests.clear()
        return states

    def close(self, reason: str) -> None:
        """Refuse every later add (the first reason stays) and wake the loop and every `wait_until`."""
        with self._lock:
            self.closed = self.closed or reason
            self._wakeup.notify()
            self._settled.notify_all()

    def wait_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait (a caller thread) until `done()` or the inbox is closed, at most until `deadline`
        (time.monotonic()); returns whether it got there. The loop calls `step_done` after each step."""
        with self._lock:
            return self._settled.wait_for(lambda: done() or self.closed is not None,
                                          timeout=max(0.0, deadline - time.monotonic()))

    def step_done(self) -> None:
        """The loop finished a step: wake the `wait_until` callers to look again."""
        with self._lock:
            self._settled.notify_all()

    def wake(self) -> None:
        """Wake the loop to look at its state again (e.g. admission reopened)."""
        with self._lock:
            self._wakeup.notify()

    def drain(self) -> list[RequestState]:
        """The loop has stopped: fail every queued control call with EngineShutdownError and hand back the queued
        requests (to be failed); the inbox is left empty."""
        with self._lock:
            states, controls = self._take_locked()
        for _, future in controls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineShutdownError(f"the engine is {self.closed}"))
        return states

    def _take_locked(self) -> tuple[list[RequestState], list[Control]]:
        states, controls = list(self._requests), list(self._controls)
        self._requests.clear()
        self._controls.clear()
        return states, controls
