"""The engine: the only denoise loop. Admit, step, finish, abort, and run control calls between steps.

A background thread owns the model and runs the loop; callers submit requests (sync `generate`, or
`await generate_async`) and control calls (`call_between_steps`, used for aborts, weight updates and sleep), which
run on the loop thread between two denoising steps, so they never race a forward.

No call hangs: every control call has a finite default timeout and raises TimeoutError naming the operation; after
`shutdown()` (or if the loop ever died) every call raises EngineShutdownError at once, and pending requests and
control calls fail with it. An engine never shut down is shut down at interpreter exit (an atexit hook).
Requests and control calls reach the loop through the `Inbox` (`engine/inbox.py`); the weights and memory state
is `lifecycle` (`engine/lifecycle.py`), changed by `engine/control.py` through public methods (`pause_admission`,
`wait_idle`, `abort_running`, `resume_admission`); `engine/admission.py` checks requests; every way a request leaves
(delivered, decoded in blocks; aborted; failed) is `engine/completion.py`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any, Callable, Iterable, Optional

import torch

from omniroll.engine import exit_hook
from omniroll.engine.admission import PromptCache, accept, attach_encodings, check_queue
from omniroll.engine.calibrate import RowCalibrator
from omniroll.engine.completion import Completion, failed
from omniroll.engine.config import EngineConfig
from omniroll.engine.control import ControlCalls, check_seconds
from omniroll.engine.control_methods import ControlMethods
from omniroll.engine.inbox import Inbox
from omniroll.engine.errors import EngineError, EngineShutdownError
from omniroll.engine.lifecycle import Lifecycle
from omniroll.engine.output import DiffusionOutput
from omniroll.engine.params import GenerationRequest
from omniroll.engine.request import RequestState
from omniroll.engine.runner import ModelRunner
from omniroll.engine.scheduler import Scheduler
from omniroll.engine.step_pause import StepPause
from omniroll.models.base import DiffusionAdapter


__all__ = ["DiffusionEngine", "EngineError", "EngineShutdownError"]


class DiffusionEngine(ControlMethods):
    """One model replica: generates samples with everything RL needs, and takes weight updates between steps.

    Build one with `DiffusionEngine.from_pretrained(path)` (or `DiffusionEngine(adapter, EngineConfig(...))` for an
    adapter you built yourself). `generate` / `generate_async` run requests, continuously batched step by step; the
    control calls (weight updates, LoRA, sleep and wake, pauses) run between two denoising steps, each with a finite
    timeout (their methods: `omniroll.engine.control_methods`). Thread-safe: any thread may call any method; a
    background thread owns the model. A Ray replica (`omniroll.rollout.RolloutReplica`) exposes the same calls.
    """

    def __init__(self, adapter: DiffusionAdapter, config: Optional[EngineConfig] = None):
        self.adapter = adapter
        self.config = config or EngineConfig()
        if self.config.num_threads is not None or self.config.row_threads > 1:
            torch.set_num_threads(self.config.num_threads or 1)  # row threads: one torch thread each
        self.runner = ModelRunner(adapter, self.config)
        self.calibrator = None
        rows = self.config.max_batch_size
        if rows == "auto":
            self.calibrator = RowCalibrator(adapter, self.runner.execution_mode, self.config.device, self.config.dtype,
                                            self.config.batch_invariant)
            rows = self.calibrator.max_batch_size_for
        self.scheduler = Scheduler(rows, prefix_sharing=self.config.prefix_sharing)
        self.prompt_cache = PromptCache(adapter, self.config.prompt_cache_size)
        self.lifecycle = Lifecycle(adapter, self.config.device, self.config.weight_update, self.config.merge_lora)
        self.steps_run = 0
        self.rows_run = 0
        self.inbox = Inbox()  # submitted requests and control calls, on their way to the loop thread
        # delivered, aborted or failed: how each request leaves (engine/completion.py)
        self.completion = Completion(self.runner, self.scheduler, self.inbox, self.config.decode_batch_size,
                                     lambda: self.lifecycle.version)
        self._thread: Optional[threading.Thread] = None
        self._thread_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self.admission_paused = False  # the admission gate (pause_admission): no new request starts
        self.step_pause = StepPause()  # the step pause (pause_generation): no denoising step runs; the loop reads it
        self.controls = ControlCalls(self)  # engine/control.py: weight, LoRA, sleep and pause calls

    # ---------------------------------------------------------- control calls: `ControlCalls` (engine/control.py)
    @property
    def weight_version(self) -> int:
        """The version of the weights the next step runs with (set by weight updates and `set_weight_version`)."""
        return self.lifecycle.version

    @weight_version.setter
    def weight_version(self, value) -> None:
        raise AttributeError("weight_version is set by weight updates; to relabel the current weights call "
                             "engine.set_weight_version(version)")

    @property
    def asleep_level(self) -> int:
        """0 when awake, else the level of the last `sleep`."""
        return self.lifecycle.asleep_level

    @property
    def served(self) -> int:
        """Samples delivered with their output."""
        return self.completion.served

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        max_batch_size: int | str = 16, **config_kwargs) -> "DiffusionEngine":
        """Load a local diffusers checkpoint directory into an engine (nothing is downloaded); the family (SD3 /
        SD3.5, FLUX.1, Qwen-Image, Wan 2.1 / 2.2) comes from its `model_index.json`. `resolve_model("tiny")` or
        `resolve_model("shapes")` (`omniroll.models`) gives a directory that works offline. `device` and `dtype` place
        the weights and forwards (the SDE step, latents and log-probs are fp32 whatever the dtype);
        `max_batch_size`: forward rows per step and batch key (a CFG request takes two), or "auto"; `config_kwargs`:
        any other `EngineConfig` field (`batch_invariant`, `decode_batch_size`, `weight_update`, `prefix_sharing`, ...:
        the docs' sampling and engine settings reference lists them)."""
        from omniroll.models import load_adapter

        config = EngineConfig(device=device, dtype=dtype, max_batch_size=max_batch_size, **config_kwargs)
        return cls(load_adapter(path, device=device, dtype=dtype), config)

    # ------------------------------------------------------------------ public API
    def generate(self, requests: Iterable[GenerationRequest], progress: bool = False) -> list[DiffusionOutput]:
        """Generate every request (continuously batched); outputs in the order of `requests`."""
        futures = self._submit_futures(list(requests))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(futures), desc="generate", unit="img")
            for f in futures:
                f.add_done_callback(lambda _: bar.update(1))
        try:
            return [f.result() for f in futures]
        finally:
            if bar is not None:
                bar.close()

    async def generate_async(self, request: GenerationRequest) -> DiffusionOutput:
        """Generate one request; cancelling the awaiting task aborts the request (acknowledged, and without blocking
        the event loop while the engine finishes its current step)."""
        future = self._submit_futures([request])[0]
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # off the event loop: an abort waits for the current step, and the loop must keep serving meanwhile
            with contextlib.suppress(EngineShutdownError):  # a shut-down engine already failed the request
                await asyncio.shield(asyncio.to_thread(self.abort, request.request_id))
            raise

    def stats(self) -> dict:
        """The engine's state as a dict: requests running and waiting, samples served, weight version, sleep level,
        the LoRA adapter, pauses, steps run and mean rows per step, prefix steps saved by group sharing, and the prompt
        cache's size, hits and misses (read without waiting for the loop)."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self.inbox),
            "served": self.served,
            "weight_version": self.lifecycle.version,
            "asleep_level": self.lifecycle.asleep_level,
            "weights_unusable": self.lifecycle.unusable,
            "admission_paused": self.admission_paused,  # e.g. an update draining its samples in flight
            "lora": self.lifecycle.active_lora,
            "shut_down": self.inbox.closed is not None,
            **self.step_pause.state(),
            "steps": self.steps_run,
            "mean_rows_per_step": self.rows_run / max(self.steps_run, 1),
            "prefix_steps_saved": self.scheduler.prefix.steps_saved if self.scheduler.prefix is not None else 0,
            "prompt_cache": {"size": len(self.prompt_cache), "hits": self.prompt_cache.hits,
                             "misses": self.prompt_cache.misses},
        }

    def sample_identity(self, timeout_s: float = 60.0) -> dict:
        """`ModelRunner.sample_identity` (what a sample's pixels depend on besides its request), between two steps."""
        return self.call_between_steps(self.runner.sample_identity, timeout_s, op="sample_identity")

    def call_between_steps(self, fn: Callable[[], Any], timeout_s: float = 60.0, op: str = "call_between_steps") -> Any:
        """Run `fn` on the engine thread between two denoising steps and return its result (or raise its error).
        Raises TimeoutError naming `op` if it has not finished within `timeout_s` (a call that had not started by
        then never runs), EngineShutdownError at once on a shut-down engine."""
        timeout_s = check_seconds("timeout_s", timeout_s)
        if self._thread is not None and threading.current_thread() is self._thread:
            return fn()
        self._ensure_thread(op)
        return self.inbox.call(fn, timeout_s, op)

    def abort(self, request_id: str, timeout_s: float = 60.0) -> bool:
        """Abort a waiting or running request; it completes with stop_reason="aborted". Returns whether it existed.
        Blocks until the request has stopped (the abort is acknowledged, never fire-and-forget)."""
        return self.call_between_steps(lambda: self.completion.abort_request(request_id), timeout_s, op="abort")

    def abort_all(self, timeout_s: float = 60.0) -> list[str]:
        """Abort every request in the engine (acknowledged). Returns their ids."""
        return self.call_between_steps(self.completion.abort_all, timeout_s, op="abort_all")

    def abort_running(self) -> list[str]:
        """Between steps: abort every running request (acknowledged); returns their ids."""
        return self.completion.abort_running()

    def pause_admission(self, timeout_s: float = 60.0, op: str = "pause_admission") -> None:
        """Admit no new request from the next step on (running ones go on); returns at that step boundary."""
        self.call_between_steps(lambda: setattr(self, "admission_paused", True), timeout_s, op=op)

    def resume_admission(self) -> None:
        self.admission_paused = False
        self.inbox.wake()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no request is running (or the engine is shut down), until `deadline` (time.monotonic());
        returns whether it got there."""
        return self.inbox.wait_until(lambda: not self.scheduler.running, deadline)

    def fail_waiting(self, error: BaseException) -> None:
        """Between steps: fail every queued and running request with (a copy per request of) `error`."""
        self.completion.fail_waiting(error)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; pending requests and control calls fail with EngineShutdownError,
        and so does every later call, at once. Idempotent."""
        self.inbox.close("shut down")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        if thread is None or not thread.is_alive():
            self.completion.fail_pending()
            self.runner.shutdown()
        exit_hook.forget(self)

    # ------------------------------------------------------------------ submission (caller threads)
    def _submit_futures(self, requests: list[GenerationRequest]) -> list[concurrent.futures.Future]:
        """Validate every request (errors raise here, in the caller's thread, before any is queued), then queue them
        all at once, so the first step already sees the whole batch. A request id already queued or running (or
        twice in `requests`) is refused with `RequestError`: ids name requests for `abort`, so they must be unique."""
        self.inbox.check_open("generate")
        futures, states = accept(self.adapter, self.config, self.runner.device, requests, self.inbox.release)
        error = self.lifecycle.admission_error(self.config.asleep_policy)
        if error is not None:
            raise error
        self._ensure_thread("generate")
        with self._submit_lock:  # the count only falls between the check and the add (the loop admits)
            check_queue(len(self.scheduler.waiting) + len(self.inbox), len(states), self.config.max_waiting)
            self.inbox.add(states)
        return futures

    def _ensure_thread(self, op: str) -> None:
        with self._thread_lock:
            self.inbox.check_open(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="omniroll-engine", daemon=True)
                self._thread.start()
                exit_hook.register(self)

    # ------------------------------------------------------------------ the loop (engine thread)
    def _loop(self) -> None:
        try:
            self._run_loop()
        except BaseException as e:  # a bug in the loop itself: refuse every call from now on, fail what is pending
            self.inbox.close(f"shut down (its loop died: {e!r})")
            raise
        finally:
            self.completion.fail_pending()

    def _run_loop(self) -> None:
        while True:
            taken = self.inbox.take(busy=self._runnable, wait_s=self.step_pause.seconds_left)
            if taken is None:
                return
            arrivals, controls = taken
            for state in arrivals:
                self.scheduler.add(state)
            if controls and self.completion.decode_queue:  # a control call never sees a sample waiting for its decode
                self.completion.deliver([], self.steps_run, flush=True)
            for control in controls:
                Inbox.run(control)
            if self._runnable():
                self._step_safely()
            if self.completion.decode_queue and not self._runnable():
                self.completion.deliver([], self.steps_run, flush=True)
            if not self.scheduler.running:
                self.inbox.step_done()

    def _runnable(self) -> bool:
        if not self.lifecycle.can_step:
            return False  # requests wait (asleep_policy="wait") until wake_up and, after level 2, a weight sync
        if self.step_pause.paused:
            return False  # samples in flight keep their state until resume_generation
        if self.admission_paused:
            return bool(self.scheduler.running)
        return self.scheduler.has_work()

    def _step_safely(self) -> None:
        try:
            self.step()
        except Exception as e:  # noqa: BLE001 - a bug outside the per-batch guards: fail loudly, lose nothing
            self.completion.settle(self.scheduler.drain_all(), failed(e))

    def step(self) -> list[DiffusionOutput]:
        """Admit, run one denoising step for one batch, finish what completed. Returns finished outputs."""
        if not self.admission_paused:
            admitted = self.scheduler.admit()
            for s in admitted:
                s.admitted_version = self.weight_version
            if admitted:
                try:
                    for s in admitted:
                        s.start()  # its latent and generator exist from admission on, not while it waits
                    self._encode(admitted)
                except Exception as e:  # noqa: BLE001 - a bug: fails the requests being admitted, not the running
                    self.completion.fail(admitted, e)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        for s in batch:
            s.running_version = self.weight_version  # recorded per step: an update may land between two steps
        try:
            self.runner.step(batch)
        except Exception as e:  # noqa: BLE001 - fails the rows of this forward only
            self.completion.fail(batch, e)
            return []
        self.steps_run += 1
        self.step_pause.count_step()
        self.rows_run += sum(s.num_rows for s in batch)
        finished = [s for s in batch if s.done]
        if finished:
            self.scheduler.finish(finished)
        return self.completion.deliver(finished, self.steps_run)

    def _encode(self, states: list[RequestState]) -> None:
        """Attach prompt encodings (see engine/admission.py); a request whose prompt fails to encode fails alone."""
        errors = dict(attach_encodings(self.prompt_cache, states))  # state -> its error
        self.scheduler.finish(list(errors))
        self.completion.settle(list(errors), errors.__getitem__)
