"""The engine's control calls: the calls other threads make into its loop (the `Inbox`, engine/inbox.py, carries
them).

`ControlCalls`: the engine's control calls: pausing generation, and the weight updates, LoRA, sleep and wake,
relabelling the weight version. Each runs on the engine thread between two denoising steps (`call_between_steps`).

Two sync policies for the samples in flight when a weight update arrives (`update_weights_from_ipc(partial=...)`):
`partial=False` (the default) quiesces (below): no sample spans two versions; `partial=True` lands the update between
two denoising steps and the samples in flight continue with the new weights, each recording the version of every
step (`step_weight_versions`, see engine/request.py). `pause_generation(after_steps=k)` / `wait_for_pause` /
`resume_generation` (`StepPause`, engine/step_pause.py) make "the update lands after step k" a deterministic schedule.

`ControlCalls` is a component of `DiffusionEngine`, as nano-vllm's engine composes its scheduler and runner (the
engine's public API keeps one class: it forwards these calls). Around `engine/lifecycle.py` it adds one control call
at a time (a lock, with the caller's timeout), a deadline for the whole call, and quiescing: close the admission gate,
let running requests drain for up to `drain_timeout_s`, abort the rest (acknowledged: each comes back with
stop_reason="aborted"), run the change between two steps, reopen the gate (also on error). It owns its lock and uses
only the engine's public surface. Two pauses, two names: the admission gate (`pause_admission`: no new request
starts; the engine's `admission_paused`) and the step pause (`pause_generation`: no denoising step runs; the
engine's `step_pause`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, Callable, Optional, Protocol

from omniroll.engine.lifecycle import SLEEP_LEVELS


def check_seconds(name: str, value: Any, allow_zero: bool = False) -> float:
    """`value` as a float number of seconds; ValueError naming `name` unless finite and positive (or zero)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number of seconds, "
                         f"got {value!r}")
    return float(value)


class EngineSurface(Protocol):
    """The part of `DiffusionEngine` the control calls use: public attributes and methods only."""

    inbox: Any
    lifecycle: Any
    prompt_cache: Any
    scheduler: Any
    steps_run: int
    step_pause: Any

    def call_between_steps(self, fn: Callable[[], Any], timeout_s: float = 60.0, op: str = "") -> Any: ...

    def pause_admission(self, timeout_s: float = 60.0, op: str = "") -> None: ...

    def resume_admission(self) -> None: ...

    def wait_idle(self, deadline: float) -> bool: ...

    def abort_running(self) -> list[str]: ...

    def fail_waiting(self, error: BaseException) -> None: ...


class ControlCalls:
    """The weight, LoRA and memory calls of an engine, each applied between two denoising steps. A component of
    `DiffusionEngine` (which forwards its public control methods here): it uses only the engine's public surface
    (`EngineSurface`: the admission gate is `pause_admission` / `resume_admission`, the step pause `step_pause`) and
    owns only its lock: one control call at a time."""

    def __init__(self, engine: EngineSurface):
        self.engine = engine
        self._control_lock = threading.Lock()  # one control call (update, LoRA, sleep, wake) at a time
        self._control_op: Optional[str] = None

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
            self.engine.step_pause.arm(after_steps, timeout_s)
            return {**self.engine.step_pause.state(), "steps": self.engine.steps_run}

        return self.engine.call_between_steps(arm, 60.0, op="pause_generation")

    def wait_for_pause(self, timeout_s: float = 60.0) -> dict:
        """Block until the pause armed by `pause_generation` has begun; TimeoutError if it has not within `timeout_s`
        (e.g. fewer steps ran than it waits for). Returns the engine's step count and the running request ids."""
        timeout_s = check_seconds("timeout_s", timeout_s)
        self.engine.inbox.check_open("wait_for_pause")
        if not self.engine.step_pause.began.wait(timeout_s):
            raise TimeoutError(f"wait_for_pause: no pause began within {timeout_s:g}s "
                               f"({self.engine.step_pause.state()})")
        return self.engine.call_between_steps(
            lambda: {"paused": self.engine.step_pause.paused, "steps": self.engine.steps_run,
                     "running": [s.request_id for s in self.engine.scheduler.running]}, timeout_s, op="wait_for_pause")

    def resume_generation(self, timeout_s: float = 60.0) -> dict:
        """End the pause (or disarm one that has not begun); returns whether generation was paused."""
        return self.engine.call_between_steps(lambda: {"resumed": self.engine.step_pause.resume()}, timeout_s,
                                              op="resume_generation")

    def set_weight_version(self, version: int, timeout_s: float = 60.0) -> dict:
        """Steps run from now on record `version` (an int >= the current one; the weights do not change)."""
        with self._control_call("set_weight_version", timeout_s) as deadline:
            return self.engine.call_between_steps(lambda: self.engine.lifecycle.set_version(version),
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
            update = self.engine.lifecycle.prepare_update(manifest, peft_config, version, name_map, buckets, use_shm)
            if update.staged:
                update.receive(buckets, use_shm)  # the engine keeps serving the old weights meanwhile

                def land():
                    return self.engine.lifecycle.commit_update(update)
            else:
                def land():
                    return self._apply_in_place(update, buckets, use_shm)
            if partial:
                return self.engine.call_between_steps(
                    lambda: {"aborted": [], "continued": [s.request_id for s in self.engine.scheduler.running],
                             **land()},
                    self._left(op, deadline), op=op)
            return self._quiesced(op, land, drain_timeout_s, deadline)

    def add_lora(self, request, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                 timeout_s: float = 120.0) -> dict:
        """Load an adapter (in-memory tensors or a saved PEFT directory) atomically between steps."""
        with self._control_call("add_lora", timeout_s) as deadline:
            version = None if version is None else self.engine.lifecycle.check_version(version)
            return self._quiesced("add_lora", lambda: self.engine.lifecycle.add_lora(request, version), drain_timeout_s,
                                  deadline)

    def remove_lora(self, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                    timeout_s: float = 120.0) -> dict:
        with self._control_call("remove_lora", timeout_s) as deadline:
            version = None if version is None else self.engine.lifecycle.check_version(version)
            return self._quiesced("remove_lora", lambda: self.engine.lifecycle.remove_lora(version), drain_timeout_s,
                                  deadline)

    def sleep(self, level: int = 1, drain_timeout_s: float = 0.0, timeout_s: float = 120.0) -> dict:
        """Free the device (see Lifecycle.sleep). Running requests are aborted (acknowledged). Sleeping at the current
        level or lower changes nothing and aborts nothing (sleep never makes the engine less asleep)."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {SLEEP_LEVELS}, got {level!r}")
        op = f"sleep(level={level})"
        with self._control_call(op, timeout_s) as deadline:
            if level <= self.engine.lifecycle.asleep_level:
                return {"level": self.engine.lifecycle.asleep_level, "changed": False, "aborted": []}

            def go():
                result = self.engine.lifecycle.sleep(level)
                self.engine.prompt_cache.clear()
                return result

            return self._quiesced(op, go, drain_timeout_s, deadline)

    def wake_up(self, timeout_s: float = 120.0) -> dict:
        """Bring the weights back to the device (a no-op when awake). After a level-2 sleep a full weight update must
        come before requests run. Errors (e.g. out of memory) reach the caller; a wake that does not finish within
        `timeout_s` raises TimeoutError instead of hanging, saying whether it never started (nothing changed) or is
        still running (it completes behind the error: `asleep_level` says when)."""
        with self._control_call("wake_up", timeout_s) as deadline:
            return self.engine.call_between_steps(self.engine.lifecycle.wake_up, self._left("wake_up", deadline),
                                                  op="wake_up")

    @contextlib.contextmanager
    def _control_call(self, op: str, timeout_s: float):
        """One control call at a time; yields its deadline."""
        timeout_s = check_seconds("timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        self.engine.inbox.check_open(op)
        if not self._control_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"{op} did not start within {timeout_s:g}s: {self._control_op} was still running")
        self._control_op = op
        try:
            self.engine.inbox.check_open(op)
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
        self.engine.pause_admission(self._left(op, deadline), op=op)
        try:
            self.engine.wait_idle(deadline if wait_all else min(time.monotonic() + drain_timeout_s, deadline))
            if wait_all and self.engine.scheduler.running:
                raise TimeoutError(f"{op}: {len(self.engine.scheduler.running)} sample(s) still in flight when its "
                                   f"timeout_s ran out (drain_timeout_s=None waits for all of them); nothing applied "
                                   f"or aborted")

            def swap():
                aborted = self.engine.abort_running()
                return {"aborted": aborted, **(fn() or {})}

            return self.engine.call_between_steps(swap, self._left(op, deadline), op=op)
        finally:
            self.engine.resume_admission()

    def _apply_in_place(self, update, buckets, use_shm: bool) -> dict:
        try:
            return self.engine.lifecycle.apply_in_place(update, buckets, use_shm)
        except BaseException:
            if self.engine.lifecycle.unusable is not None:  # nothing may run on these weights: fail what waits for them
                self.engine.fail_waiting(self.engine.lifecycle.unusable_error())
            raise
