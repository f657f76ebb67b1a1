"""The calls other threads make into the engine's loop, and the inbox that carries them.

`Inbox`: what caller threads hand to the engine thread: new requests and control calls, and the ids of requests in
flight. Callers `add` requests (ids must be unique among queued and running requests, since `abort(id)` names one)
and `call` functions to run between two steps; the loop thread `take`s everything at once, waiting while there is
nothing to do, and `run`s the calls. After `close(reason)` every add raises EngineShutdownError and `drain` fails
what was left. The inbox owns its lock; nothing else reads its queues.

`ControlCalls`: the engine's control calls: pausing generation, and the weight updates, LoRA, sleep and wake,
relabelling the weight version. Each runs on the engine thread between two denoising steps (`call_between_steps`).

Two sync policies for the samples in flight when a weight update arrives (`update_weights_from_ipc(partial=...)`):
`partial=False` (the default) quiesces (below): no sample spans two versions; `partial=True` lands the update between
two denoising steps and the samples in flight continue with the new weights, each recording the version of every
step (`step_weight_versions`, see engine/request.py). `pause_generation(after_steps=k)` / `wait_for_pause` /
`resume_generation` (`StepPause`, engine/lifecycle.py) make "the update lands after step k" a deterministic schedule.

`ControlCalls` is a mixin of `DiffusionEngine` (the engine's public API keeps one class). Around
`engine/lifecycle.py` it adds one control call at a time (a lock, with the caller's timeout), a deadline for the
whole call, and quiescing: close admission, let running requests drain for up to `drain_timeout_s`, abort the rest
(acknowledged: each comes back with stop_reason="aborted"), run the change between two steps, reopen admission (also
on error). It owns `_control_lock` / `_control_op` and uses only the engine's public surface, declared below.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from omniroll.engine.admission import PromptCache
from omniroll.engine.errors import EngineShutdownError, RequestError
from omniroll.engine.lifecycle import SLEEP_LEVELS, Lifecycle, StepPause
from omniroll.engine.request import RequestState
from omniroll.engine.scheduler import Scheduler


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
        `timeout_s`; a call that had not started by then never runs."""
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
            future.cancel()
            raise TimeoutError(f"{op} did not finish within {timeout_s:g}s (the engine thread was busy with a step "
                               f"or an earlier call)") from None

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


def check_seconds(name: str, value: Any, allow_zero: bool = False) -> float:
    """`value` as a float number of seconds; ValueError naming `name` unless finite and positive (or zero)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number of seconds, "
                         f"got {value!r}")
    return float(value)


class ControlCalls:
    """The weight, LoRA and memory calls of the engine, each applied between two denoising steps."""

    # the host engine's public surface this mixin uses (DiffusionEngine defines every one of them)
    inbox: Inbox
    lifecycle: Lifecycle
    prompt_cache: PromptCache
    call_between_steps: Callable[..., Any]
    pause_admission: Callable[..., None]
    resume_admission: Callable[[], None]
    wait_idle: Callable[[float], bool]
    abort_running: Callable[[], list[str]]
    fail_waiting: Callable[[BaseException], None]
    scheduler: Scheduler
    steps_run: int

    def _init_controls(self) -> None:
        self._control_lock = threading.Lock()  # one control call (update, LoRA, sleep, wake) at a time
        self._control_op: Optional[str] = None
        self._pause = StepPause()  # pause_generation / resume_generation (engine/lifecycle.py); the loop reads it

    def pause_generation(self, after_steps: int = 0, timeout_s: float = 300.0) -> dict:
        """Run `after_steps` more denoising steps (forwards of the engine; 0: none), then pause: no step runs until
        `resume_generation()`, or until `timeout_s` has passed since the pause began (then generation resumes by
        itself: nothing hangs). Samples in flight keep their state (nothing is aborted), new requests queue, control
        calls still run: a `partial=True` weight update sent while paused lands after exactly those steps. Returns
        once armed (see `wait_for_pause`); arming again replaces the previous pause. A `partial=False` update while
        paused cannot drain the paused samples (it aborts them after its `drain_timeout_s`)."""
        if isinstance(after_steps, bool) or not isinstance(after_steps, int) or after_steps < 0:
            raise ValueError(f"after_steps must be an int >= 0, got {after_steps!r}")
        timeout_s = check_seconds("timeout_s", timeout_s)

        def arm():
            self._pause.arm(after_steps, timeout_s)
            return {**self._pause.state(), "steps": self.steps_run}

        return self.call_between_steps(arm, 60.0, op="pause_generation")

    def wait_for_pause(self, timeout_s: float = 60.0) -> dict:
        """Block until the pause armed by `pause_generation` has begun; TimeoutError if it has not within `timeout_s`
        (e.g. fewer steps ran than it waits for). Returns the engine's step count and the running request ids."""
        timeout_s = check_seconds("timeout_s", timeout_s)
        self.inbox.check_open("wait_for_pause")
        if not self._pause.began.wait(timeout_s):
            raise TimeoutError(f"wait_for_pause: no pause began within {timeout_s:g}s ({self._pause.state()})")
        return self.call_between_steps(
            lambda: {"paused": self._pause.paused, "steps": self.steps_run,
                     "running": [s.request_id for s in self.scheduler.running]}, timeout_s, op="wait_for_pause")

    def resume_generation(self, timeout_s: float = 60.0) -> dict:
        """End the pause (or disarm one that has not begun); returns whether generation was paused."""
        return self.call_between_steps(lambda: {"resumed": self._pause.resume()}, timeout_s, op="resume_generation")

    def set_weight_version(self, version: int, timeout_s: float = 60.0) -> dict:
        """Steps run from now on record `version` (an int >= the current one; the weights do not change)."""
        with self._control_call("set_weight_version", timeout_s) as deadline:
            return self.call_between_steps(lambda: self.lifecycle.set_version(version),
                                           self._left("set_weight_version", deadline), op="set_weight_version")

    def update_weights_from_ipc(self, peft_config: Optional[dict] = None, base_sync_done: bool = False,
                                use_shm: bool = False, *, manifest, buckets, version: int,
                                name_map: Optional[Callable[[str], str]] = None,
                                drain_timeout_s: Optional[float] = 10.0, timeout_s: float = 600.0,
                                partial: bool = False) -> dict:
        """Apply one update from a stream of named-tensor buckets (see omniroll.weights.WeightSender), as a
        transaction (see engine/lifecycle.py): version (an int > the current one), names, shapes and dtypes are
        checked first, before anything is drained or aborted; values (finite) as they arrive; no step ever runs on
        a partly updated model. With `peft_config` it is a LoRA update, else full weights. Every step run afterwards
        records `version`. The samples in flight:
          partial=False  none spans two versions: admission closes, running samples finish on the old weights for
                         up to `drain_timeout_s` (None: for as long as `timeout_s` allows, and if some still run
                         then, TimeoutError: nothing applied, nothing aborted), what still runs after it is aborted
                         (acknowledged; the ack's "aborted" lists them), the update lands, admission reopens.
          partial=True   nothing waits and nothing is aborted: the update lands between two denoising steps and the
                         samples in flight continue from their current latent with the new weights (the ack's
                         "continued" lists them); `drain_timeout_s` is unused.
        Returns the acknowledgement."""
        if not isinstance(partial, bool):
            raise ValueError(f"partial must be a bool, got {partial!r}")
        op = "update_weights_from_ipc"
        with self._control_call(op, timeout_s) as deadline:
            update = self.lifecycle.prepare_update(manifest, peft_config, version, name_map, buckets, use_shm)
            if update.staged:
                update.receive(buckets, use_shm)  # the engine keeps serving the old weights meanwhile

                def land():
                    return self.lifecycle.commit_update(update)
            else:
                def land():
                    return self._apply_in_place(update, buckets, use_shm)
            if partial:
                return self.call_between_steps(
                    lambda: {"aborted": [], "continued": [s.request_id for s in self.scheduler.running], **land()},
                    self._left(op, deadline), op=op)
            return self._quiesced(op, land, drain_timeout_s, deadline)

    def add_lora(self, request, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                 timeout_s: float = 120.0) -> dict:
        """Load an adapter (in-memory tensors or a saved PEFT directory) atomically between steps."""
        with self._control_call("add_lora", timeout_s) as deadline:
            version = None if version is None else self.lifecycle.check_version(version)
            return self._quiesced("add_lora", lambda: self.lifecycle.add_lora(request, version), drain_timeout_s,
                                  deadline)

    def remove_lora(self, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                    timeout_s: float = 120.0) -> dict:
        with self._control_call("remove_lora", timeout_s) as deadline:
            version = None if version is None else self.lifecycle.check_version(version)
            return self._quiesced("remove_lora", lambda: self.lifecycle.remove_lora(version), drain_timeout_s,
                                  deadline)

    def sleep(self, level: int = 1, drain_timeout_s: float = 0.0, timeout_s: float = 120.0) -> dict:
        """Free the device (see Lifecycle.sleep). Running requests are aborted (acknowledged). Sleeping at the current
        level or lower changes nothing and aborts nothing (sleep never makes the engine less asleep)."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        op = f"sleep(level={level})"
        with self._control_call(op, timeout_s) as deadline:
            if level <= self.lifecycle.asleep_level:
                return {"level": self.lifecycle.asleep_level, "changed": False, "aborted": []}

            def go():
                result = self.lifecycle.sleep(level)
                self.prompt_cache.clear()
                return result

            return self._quiesced(op, go, drain_timeout_s, deadline)

    def wake_up(self, timeout_s: float = 120.0) -> dict:
        """Bring the weights back to the device (a no-op when awake). After a level-2 sleep a full weight update must
        come before requests run. Errors (e.g. out of memory) reach the caller; a wake that does not finish within
        `timeout_s` raises TimeoutError instead of hanging."""
        with self._control_call("wake_up", timeout_s) as deadline:
            return self.call_between_steps(self.lifecycle.wake_up, self._left("wake_up", deadline), op="wake_up")

    @contextlib.contextmanager
    def _control_call(self, op: str, timeout_s: float):
        """One control call at a time; yields its deadline."""
        timeout_s = check_seconds("timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        self.inbox.check_open(op)
        if not self._control_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"{op} did not start within {timeout_s:g}s: {self._control_op} was still running")
        self._control_op = op
        try:
            self.inbox.check_open(op)
            yield deadline
        finally:
            self._control_op = None
            self._control_lock.release()

    @staticmethod
    def _left(op: str, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{op} ran out of its timeout")
        return left

    def _quiesced(self, op: str, fn: Callable[[], Any], drain_timeout_s: Optional[float], deadline: float) -> dict:
        """Close admission, let running requests finish for up to `drain_timeout_s`, abort the rest (acknowledged:
        each comes back with stop_reason="aborted"), run `fn` between steps, reopen admission (also on error).
        `drain_timeout_s=None`: wait until `deadline` for every running request; if some still run, TimeoutError
        and nothing is aborted or run."""
        wait_all = drain_timeout_s is None
        if not wait_all:
            drain_timeout_s = check_seconds("drain_timeout_s", drain_timeout_s, allow_zero=True)
        self.pause_admission(self._left(op, deadline), op=op)
        try:
            self.wait_idle(deadline if wait_all else min(time.monotonic() + drain_timeout_s, deadline))
            if wait_all and self.scheduler.running:
                raise TimeoutError(f"{op}: {len(self.scheduler.running)} sample(s) still in flight when its timeout_s "
                                   f"ran out (drain_timeout_s=None waits for all of them); nothing applied or aborted")

            def swap():
                aborted = self.abort_running()
                return {"aborted": aborted, **(fn() or {})}

            return self.call_between_steps(swap, self._left(op, deadline), op=op)
        finally:
            self.resume_admission()

    def _apply_in_place(self, update, buckets, use_shm: bool) -> dict:
        try:
            return self.lifecycle.apply_in_place(update, buckets, use_shm)
        except BaseException:
            if self.lifecycle.unusable is not None:  # nothing may run on these weights: fail what waits for them
                self.fail_waiting(self.lifecycle.unusable_error())
            raise
