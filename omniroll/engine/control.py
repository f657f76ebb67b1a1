"""The engine's control calls: weight updates, LoRA, sleep and wake, relabelling the weight version. Each runs on
the engine thread between two denoising steps (`call_between_steps`).

`ControlCalls` is a mixin of `DiffusionEngine` (the engine's public API keeps one class). Around
`engine/lifecycle.py` it adds one control call at a time (a lock, with the caller's timeout), a deadline for the
whole call, and quiescing: close admission, let running requests drain for up to `drain_timeout_s`, abort the rest
(acknowledged: each comes back with stop_reason="aborted"), run the change between two steps, reopen admission (also
on error). It owns `_control_lock` / `_control_op` and uses only the engine's public surface, declared below.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, Callable, Optional

from omniroll.engine.inbox import Inbox
from omniroll.engine.lifecycle import SLEEP_LEVELS, Lifecycle
from omniroll.engine.prompt_cache import PromptCache


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

    def _init_controls(self) -> None:
        self._control_lock = threading.Lock()  # one control call (update, LoRA, sleep, wake) at a time
        self._control_op: Optional[str] = None

    def set_weight_version(self, version: int, timeout_s: float = 60.0) -> dict:
        """Samples admitted from now on record `version` (an int >= the current one; the weights do not change)."""
        with self._control_call("set_weight_version", timeout_s) as deadline:
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
        with self._control_call(op, timeout_s) as deadline:
            update = self.lifecycle.prepare_update(manifest, peft_config, version, name_map, buckets, use_shm)
            if update.staged:
                update.receive(buckets, use_shm)  # the engine keeps serving the old weights meanwhile
                return self._quiesced(op, lambda: self.lifecycle.commit_update(update), drain_timeout_s, deadline)
            return self._quiesced(op, lambda: self._apply_in_place(update, buckets, use_shm), drain_timeout_s,
                                  deadline)

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

    def _quiesced(self, op: str, fn: Callable[[], Any], drain_timeout_s: float, deadline: float) -> dict:
        """Close admission, let running requests finish for up to `drain_timeout_s`, abort the rest (acknowledged:
        each comes back with stop_reason="aborted"), run `fn` between steps, reopen admission (also on error)."""
        drain_timeout_s = check_seconds("drain_timeout_s", drain_timeout_s, allow_zero=True)
        self.pause_admission(self._left(op, deadline), op=op)
        try:
            self.wait_idle(min(time.monotonic() + drain_timeout_s, deadline))

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
