"""Weight updates, weight versions and sleep / wake for the engine.

Consistency rule: no sample ever mixes weights. An update (1) pauses admission, (2) lets running requests finish for
up to `drain_timeout_s`, (3) aborts the rest and waits until they have stopped (each comes back with
stop_reason="aborted"; clients re-run it with the same seed), (4) swaps the weights on the engine thread between two
steps, (5) bumps the weight version and resumes admission. Requests that were waiting (not yet admitted) have run no
step: they start on the new weights and record the new version.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from omniroll.weights import LoRAManager, OmniTensorLoRARequest, apply_weight_update


class EngineAsleepError(RuntimeError):
    pass


class EngineLifecycleMixin:
    """Mixed into DiffusionEngine; relies on its scheduler, call_between_steps and admission flag."""

    asleep_level: int = 0
    needs_weight_sync: bool = False
    _lora_manager: Optional[LoRAManager] = None

    @property
    def lora_manager(self) -> LoRAManager:
        if self._lora_manager is None:
            self._lora_manager = LoRAManager(self.adapter.denoiser)
        return self._lora_manager

    # ------------------------------------------------------------------ draining
    def _pause_and_drain(self, drain_timeout_s: float) -> None:
        self.call_between_steps(lambda: setattr(self, "admission_paused", True))
        deadline = time.monotonic() + max(drain_timeout_s, 0.0)
        while self.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.002)

    def _resume(self) -> None:
        self.call_between_steps(lambda: setattr(self, "admission_paused", False))

    def _quiesced(self, fn: Callable[[], Any], drain_timeout_s: float, timeout_s: Optional[float]) -> dict:
        """Pause, drain, abort what is left (acknowledged), run `fn` between steps, resume (also on error)."""
        self._pause_and_drain(drain_timeout_s)
        try:
            def swap():
                aborted = self._abort_running_now()
                return {"aborted": aborted, **(fn() or {})}

            return self.call_between_steps(swap, timeout=timeout_s)
        finally:
            self._resume()

    def _abort_running_now(self) -> list[str]:
        states = list(self.scheduler.running)
        self.scheduler.finish(states)
        return self._settle_aborted(states)

    # ------------------------------------------------------------------ weight updates
    def update_weights_from_ipc(self, peft_config: Optional[dict] = None, base_sync_done: bool = False,
                                use_shm: bool = False, *, manifest, buckets, version: int,
                                name_map: Optional[Callable[[str], str]] = None, drain_timeout_s: float = 10.0,
                                timeout_s: Optional[float] = 600.0) -> dict:
        """Apply one update from a stream of named-tensor buckets (see omniroll.weights.WeightSender).

        With `peft_config` it is a LoRA update (all buckets accumulated, the adapter swapped atomically), else full
        weights (every name validated before the first copy, then bucket by bucket in place). `version` is the
        trainer's global step; every sample admitted afterwards records it. Returns the acknowledgement.
        """
        if self.asleep_level:
            raise EngineAsleepError("engine is asleep: call wake_up() before a weight update")

        def apply():
            ack = apply_weight_update(self.adapter.denoiser, self.lora_manager, manifest=manifest, buckets=buckets,
                                      peft_config=peft_config, use_shm=use_shm, name_map=name_map, version=version)
            self.weight_version = int(version)
            if peft_config is None:
                self.needs_weight_sync = False
            return ack

        return self._quiesced(apply, drain_timeout_s, timeout_s)

    def add_lora(self, request: OmniTensorLoRARequest, version: Optional[int] = None,
                 drain_timeout_s: float = 10.0) -> dict:
        """Load an adapter (in-memory tensors or a saved PEFT directory) atomically between steps."""
        def apply():
            self.lora_manager.add_lora(request)
            if version is not None:
                self.weight_version = int(version)
            return {"lora_name": request.lora_name, "version": self.weight_version}

        return self._quiesced(apply, drain_timeout_s, None)

    def remove_lora(self, version: Optional[int] = None, drain_timeout_s: float = 10.0) -> dict:
        def apply():
            removed = self.lora_manager.remove_lora()
            if version is not None:
                self.weight_version = int(version)
            return {"removed": removed, "version": self.weight_version}

        return self._quiesced(apply, drain_timeout_s, None)

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, level: int = 1, drain_timeout_s: float = 0.0, timeout_s: Optional[float] = 120.0) -> dict:
        """Free the device. level 1: weights move to host memory. level 2: the denoiser's weights are dropped
        (a full weight sync must come before the next generation); text encoders and VAE are offloaded as in
        level 1, since trainers never sync them. Returns once done; running requests are aborted (acknowledged)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")

        def go():
            self.asleep_level = level  # on the engine thread: nothing is admitted from here on
            for name, module in self.adapter.modules().items():
                if level == 2 and module is self.adapter.denoiser:
                    module.to_empty(device="meta")
                else:
                    module.to("cpu")
            if level == 2:
                self.needs_weight_sync = True
            self.prompt_cache.clear()
            self._empty_device_cache()
            return {"level": level}

        return self._quiesced(go, drain_timeout_s, timeout_s)

    def wake_up(self, timeout_s: Optional[float] = 120.0) -> dict:
        """Bring the weights back to the device. After a level-2 sleep the denoiser gets fresh storage that a full
        weight sync must fill before requests run again. Errors (e.g. out of memory) reach the caller; a wake that
        does not finish within `timeout_s` raises TimeoutError instead of hanging."""
        device = torch.device(self.config.device)

        def go():
            for module in self.adapter.modules().values():
                if any(p.is_meta for p in module.parameters()):
                    module.to_empty(device=device)
                else:
                    module.to(device)
            self.asleep_level = 0
            return {"awake": True, "needs_weight_sync": self.needs_weight_sync}

        return self.call_between_steps(go, timeout=timeout_s)

    def _check_awake(self) -> None:
        """Called when a request is submitted."""
        if self.asleep_level and self.config.asleep_policy == "error":
            raise EngineAsleepError(f"engine is asleep (level {self.asleep_level}); call wake_up() first")
        if not self.asleep_level and self.needs_weight_sync:
            raise EngineAsleepError("weights were dropped by sleep(level=2): a full weight sync must come first")

    @staticmethod
    def _empty_device_cache() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
