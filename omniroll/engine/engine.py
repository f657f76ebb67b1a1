"""The engine: the only denoise loop. Admit, step, finish, abort, and run control calls between steps.

A background thread owns the model and runs the loop; callers submit requests (sync `generate`, or
`await generate_async`) and control calls (`call_between_steps`, used for aborts, weight updates and sleep), which
run on the loop thread between two denoising steps, so they never race a forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Optional

import torch

from omniroll.engine.config import EngineConfig
from omniroll.engine.lifecycle import EngineLifecycleMixin
from omniroll.engine.output import DiffusionOutput
from omniroll.engine.packaging import aborted_output, build_output
from omniroll.engine.params import GenerationRequest
from omniroll.engine.prompt_cache import PromptCache
from omniroll.engine.request import RequestState
from omniroll.engine.runner import ModelRunner
from omniroll.engine.scheduler import Scheduler
from omniroll.models.base import DiffusionAdapter


class EngineError(RuntimeError):
    pass


class DiffusionEngine(EngineLifecycleMixin):
    def __init__(self, adapter: DiffusionAdapter, config: Optional[EngineConfig] = None):
        self.adapter = adapter
        self.config = config or EngineConfig()
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.runner = ModelRunner(adapter, self.config)
        self.scheduler = Scheduler(self.config.max_batch_size, prefix_sharing=self.config.prefix_sharing)
        self.prompt_cache = PromptCache(adapter, self.config.prompt_cache_size)
        self.weight_version = 0
        self.served = 0
        self.steps_run = 0
        self.rows_run = 0
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: deque[RequestState] = deque()
        self._controls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self.admission_paused = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        max_batch_size: int = 16, **config_kwargs) -> "DiffusionEngine":
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
        """Generate one request; cancelling the awaiting task aborts the request."""
        future = self._submit_futures([request])[0]
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; it completes with stop_reason="aborted". Returns whether it existed.
        Blocks until the request has stopped (the abort is acknowledged, never fire-and-forget)."""
        return self.call_between_steps(lambda: self._abort_now(request_id))

    def abort_all(self) -> list[str]:
        """Abort every request in the engine (acknowledged). Returns their ids."""
        return self.call_between_steps(self._abort_all_now)

    def stats(self) -> dict:
        with self._lock:
            inbox = len(self._inbox)
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + inbox,
            "served": self.served,
            "weight_version": self.weight_version,
            "asleep_level": self.asleep_level,
            "lora": self._lora_manager.active_lora if self._lora_manager is not None else None,
            "steps": self.steps_run,
            "mean_rows_per_step": self.rows_run / max(self.steps_run, 1),
            "prefix_steps_saved": self.scheduler.prefix.steps_saved if self.scheduler.prefix is not None else 0,
            "prompt_cache": {"size": len(self.prompt_cache), "hits": self.prompt_cache.hits,
                             "misses": self.prompt_cache.misses},
        }

    def call_between_steps(self, fn: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        """Run `fn` on the engine thread between two denoising steps and return its result (or raise its error)."""
        if self._thread is not None and threading.current_thread() is self._thread:
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._ensure_thread()
            self._controls.append((fn, future))
            self._wakeup.notify()
        return future.result(timeout=timeout)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for state in self.scheduler.drain_all() + list(self._inbox):
            state.on_done(None, EngineError("engine shut down"))
        self._inbox.clear()

    # ------------------------------------------------------------------ submission (caller threads)
    def _submit_futures(self, requests: list[GenerationRequest]) -> list[concurrent.futures.Future]:
        """Validate every request (errors raise here, in the caller's thread, before any is queued), then queue them
        all at once, so the first step already sees the whole batch."""
        futures, states = [], []
        for request in requests:
            future: concurrent.futures.Future = concurrent.futures.Future()
            states.append(self._make_state(request, _resolver(future)))
            futures.append(future)
        self._check_awake()
        with self._lock:
            if self._stopped:
                raise EngineError("engine is shut down")
            self._ensure_thread()
            self._inbox.extend(states)
            self._wakeup.notify()
        return futures

    def _make_state(self, request: GenerationRequest, on_done) -> RequestState:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        p = request.sampling_params
        self.adapter.limits.check(p.height, p.width, p.max_sequence_length, prefix="sampling_params.")
        for field, ids in (("prompt_token_ids", request.prompt_token_ids),
                           ("negative_prompt_token_ids", request.negative_prompt_token_ids)):
            if ids is not None:
                self.adapter.check_token_ids(ids, p.max_sequence_length, field)
        latent_shape = self.adapter.latent_shape(p.height, p.width)
        sigmas = self.adapter.sigmas(p.num_inference_steps, p.height, p.width)
        return RequestState(request, sigmas, latent_shape, on_done)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="omniroll-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the loop (engine thread)
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self._controls and not self._inbox and not self._runnable():
                    self._wakeup.wait()
                if self._stopped:
                    return
                controls = list(self._controls)
                self._controls.clear()
                arrivals = list(self._inbox)
                self._inbox.clear()
            for state in arrivals:
                self.scheduler.add(state)
            for fn, future in controls:
                self._run_control(fn, future)
            if self._runnable():
                self._step_safely()

    def _runnable(self) -> bool:
        if self.asleep_level or self.needs_weight_sync:
            return False  # requests wait (asleep_policy="wait") until wake_up and, after level 2, a weight sync
        if self.admission_paused:
            return bool(self.scheduler.running)
        return self.scheduler.has_work()

    @staticmethod
    def _run_control(fn, future) -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            future.set_exception(e)

    def _step_safely(self) -> None:
        try:
            self.step()
        except Exception as e:  # noqa: BLE001 - a bug outside the per-batch guards: fail loudly, lose nothing
            for state in self.scheduler.drain_all():
                state.on_done(None, EngineError(f"request {state.request_id} failed: {e!r}"))

    def _fail(self, states: list[RequestState], error: BaseException) -> None:
        """Fail these requests (and only these) with `error`."""
        self.scheduler.finish(states)
        for s in states:
            s.on_done(None, EngineError(f"request {s.request_id} failed: {error!r}"))

    def step(self) -> list[DiffusionOutput]:
        """Admit, run one denoising step for one batch, finish what completed. Returns finished outputs."""
        if not self.admission_paused:
            admitted = self.scheduler.admit()
            for s in admitted:
                s.weight_version = self.weight_version  # admission fixes the weights a sample is made with
            if admitted:
                try:
                    self._encode(admitted)
                except Exception as e:  # noqa: BLE001 - fails the requests being admitted, not the running ones
                    self._fail(admitted, e)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            self.runner.step(batch)
        except Exception as e:  # noqa: BLE001 - fails the rows of this forward only
            self._fail(batch, e)
            return []
        self.steps_run += 1
        self.rows_run += sum(s.num_rows for s in batch)
        finished = [s for s in batch if s.done]
        if not finished:
            return []
        self.scheduler.finish(finished)
        return self._finish(finished)

    def _encode(self, states: list[RequestState]) -> None:
        by_len: dict[int, list[RequestState]] = {}
        for s in states:
            by_len.setdefault(s.params.max_sequence_length, []).append(s)
        for length, group in by_len.items():
            conds = self.prompt_cache.get_many([s.request.prompt_input() for s in group], length)
            cfg = [s for s in group if s.params.do_cfg]
            negs = self.prompt_cache.get_many([s.request.negative_input() for s in cfg], length)
            for s, c in zip(group, conds):
                s.cond = c
            for s, c in zip(cfg, negs):
                s.uncond = c

    def _finish(self, states: list[RequestState]) -> list[DiffusionOutput]:
        need_pixels = [s for s in states if s.params.output_type in ("pixel", "both")]
        pixels = {}
        if need_pixels:
            decoded = self.runner.decode(torch.stack([s.latents for s in need_pixels]))
            pixels = {id(s): decoded[i] for i, s in enumerate(need_pixels)}
        outputs = []
        for s in states:
            try:
                out = build_output(s, pixels.get(id(s)))
            except Exception as e:  # e.g. NaN pixels: this request fails loudly, the others go on
                s.on_done(None, e)
                continue
            self.served += 1
            outputs.append(out)
            s.on_done(out, None)
        return outputs

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


def _resolver(future: concurrent.futures.Future):
    """The RequestState callback that settles `future` exactly once."""

    def on_done(output, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(output)

    return on_done
