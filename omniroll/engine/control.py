"""The engine's control calls: aborts, and the lifecycle calls (weight updates, LoRA, sleep and wake, relabelling the
weight version). Each runs on the engine thread between two denoising steps (`call_between_steps`).

`ControlCalls` is a mixin of `DiffusionEngine` (the engine's public API keeps one class). An abort is acknowledged:
the request completes with stop_reason="aborted" before the call returns. Around `engine/lifecycle.py` it adds one
lifecycle call at a time (a lock, with the caller's timeout), a deadline for the whole call, and quiescing: close
admission, let running requests drain for up to `drain_timeout_s`, abort the rest (acknowledged), run the change
between two steps, reopen admission (also on error). The mixin uses the engine's `call_between_steps`, scheduler,
inbox and lock.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, Callable, Optional

from omniroll.engine.lifecycle import SLEEP_LEVELS
from omniroll.engine.packaging import aborted_output
from omniroll.engine.request import RequestState


def check_seconds(name: str, value: Any, allow_zero: bool = False) -> float:
    """`value` as a float number of seconds; ValueError naming `name` unless finite and positive (or zero)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number of seconds, "
                         f"got {value!r}")
    return float(value)


class ControlCalls:
    """Aborts, and the weight, LoRA and memory calls of the engine, each applied between two denoising steps."""

    _lifecycle_lock: threading.Lock
    _lifecycle_op: Optional[str]

    def abort(self, request_id: str, timeout_s: float = 60.0) -> bool:
        """Abort a waiting or running request; it completes with stop_reason="aborted". Returns whether it existed.
        Blocks until the request has stopped (the abort is acknowledged, never fire-and-forget)."""
        return self.call_between_steps(lambda: self._abort_now(request_id), timeout_s, op="abort")

    def abort_all(self, timeout_s: float = 60.0) -> list[str]:
        """Abort every request in the engine (acknowledged). Returns their ids."""
        return self.call_between_steps(self._abort_all_now, timeout_s, op="abort_all")

    def set_weight_version(self, version: int, timeout_s: float = 60.0) -> dict:
        """Samples admitted from now on record `version` (an int >= the current one; the weights do not change)."""
        with self._lifecycle_call("set_weight_version", timeout_s) as deadline:
            return self.call_between_steps(lambda: self.lifecycle.set_version(version),
                                           self._left("set_weight_version", deadline), op="set_weight_version")

    def update_weights_from_ipc(self, peft_config: Optional[dict] = None, base_sync_done: bool = False,
                                use_shm: bool = False, *, manifest, buckets, version: int,
                                name_map: Optional[Callable[[str], str]] = None, drain_timeout_s: float = 10.0,
                                timeout_s: float = 600.0) -> dict:
        """Apply one update from a stream of named-tensor buckets (see omniroll.weights.WeightSender), as a
        transaction (see engine/lifecycle.py): version (an int > the current one), names, shapes and dtypes are
        checked first, before anything is drained or aborted; values (finite) as they arrive; no sample is ever
        produced from a partly updated model. With `peft_config` it is a LoRA update, else full weights. Every
        sample admitted afterwards records `version`. Returns the acknowledgement (with the aborted request ids)."""
        op = "update_weights_from_ipc"
        with self._lifecycle_call(op, timeout_s) as deadline:
            update = self.lifecycle.prepare_update(manifest, peft_config, version, name_map, buckets, use_shm)
            if update.staged:
                update.receive(buckets, use_shm)  # the engine keeps serving the old weights meanwhile
                return self._quiesced(op, lambda: self.lifecycle.commit_update(update), drain_timeout_s, deadline)
            return self._quiesced(op, lambda: self._apply_in_place(update, buckets, use_shm), drain_timeout_s,
                                  deadline)

    def add_lora(self, request, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                 timeout_s: float = 120.0) -> dict:
        """Load an adapter (in-memory tensors or a saved PEFT directory) atomically between steps."""
        with self._lifecycle_call("add_lora", timeout_s) as deadline:
            version = None if version is None else self.lifecycle.check_version(version)
            return self._quiesced("add_lora", lambda: self.lifecycle.add_lora(request, version), drain_timeout_s,
                                  deadline)

    def remove_lora(self, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                    timeout_s: float = 120.0) -> dict:
        with self._lifecycle_call("remove_lora", timeout_s) as deadline:
            version = None if version is None else self.lifecycle.check_version(version)
            return self._quiesced("remove_lora", lambda: self.lifecycle.remove_lora(version), drain_timeout_s,
                                  deadline)

    def sleep(self, level: int = 1, drain_timeout_s: float = 0.0, timeout_s: float = 120.0) -> dict:
        """Free the device (see Lifecycle.sleep). Running requests are aborted (acknowledged). Sleeping at the current
        level or lower changes nothing and aborts nothing (sleep never makes the engine less asleep)."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        op = f"sleep(level={level})"
        with self._lifecycle_call(op, timeout_s) as deadline:
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
        with self._lifecycle_call("wake_up", timeout_s) as deadline:
            return self.call_between_steps(self.lifecycle.wake_up, self._left("wake_up", deadline), op="wake_up")

    @contextlib.contextmanager
    def _lifecycle_call(self, op: str, timeout_s: float):
        """One lifecycle call at a time; yields its deadline."""
        timeout_s = check_seconds("timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        self._check_open(op)
        if not self._lifecycle_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"{op} did not start within {timeout_s:g}s: {self._lifecycle_op} was still running")
        self._lifecycle_op = op
        try:
            self._check_open(op)
            yield deadline
        finally:
            self._lifecycle_op = None
            self._lifecycle_lock.release()

    @staticmethod
    def _left(op: str, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{op} ran out of its timeout")
        return left

    def _quiesced(self, op: str, fn: Callable[[], Any], drain_timeout_s: float, deadline: float) -> dict:
        """Close admission, let running requests finish for up to `drain_timeout_s`, abort the rest (acknowledged:
        each comes back with stop_reason="aborted"), run `fn` between steps, reopen admission (also on error)."""
        drain_timeout_s = check_seconds("drain_timeout_s", drain_timeout_s, allow_zero=True)
        self.call_between_steps(lambda: setattr(self, "admission_paused", True), self._left(op, deadline), op=op)
        try:
            drain_until = min(time.monotonic() + drain_timeout_s, deadline)
            while self.scheduler.running and time.monotonic() < drain_until and self._closed is None:
                time.sleep(0.002)

            def swap():
                aborted = self._abort_running_now()
                return {"aborted": aborted, **(fn() or {})}

            return self.call_between_steps(swap, self._left(op, deadline), op=op)
        finally:
            with self._lock:
                self.admission_paused = False
                self._wakeup.notify()

    def _apply_in_place(self, update, buckets, use_shm: bool) -> dict:
        try:
            return self.lifecycle.apply_in_place(update, buckets, use_shm)
        except BaseException:
            if self.lifecycle.unusable is not None:  # nothing may run on these weights: fail what waits for them
                error = self.lifecycle.unusable_error()
                with self._lock:
                    waiting = list(self._inbox)
                    self._inbox.clear()
                for s in self.scheduler.drain_all() + waiting:
                    s.on_done(None, type(error)(f"request {s.request_id}: {error}"))
            raise

    def _abort_running_now(self) -> list[str]:
        states = list(self.scheduler.running)
        self.scheduler.finish(states)
        return self._settle_aborted(states)

    def _abort_now(self, request_id: str) -> bool:
        with self._lock:
            for s in list(self._inbox):
                if s.request_id == request_id:
                    self._inbox.remove(s)
                    self._settle_aborted([s])
                    return True
        state = self.scheduler.remove(request_id)
        if state is None:
            return False
        self._settle_aborted([state])
        return True

    def _abort_all_now(self) -> list[str]:
        with self._lock:
            states = list(self._inbox)
            self._inbox.clear()
        states += self.scheduler.drain_all()
        return self._settle_aborted(states)

    def _settle_aborted(self, states: list[RequestState]) -> list[str]:
        """Complete these (already removed) requests with stop_reason="aborted"; returns their ids."""
        for s in states:
            s.on_done(aborted_output(s, self.weight_version), None)
        return [s.request_id for s in states]
