"""The engine's public control methods (pauses, weight versions, weight updates, LoRA, sleep and wake): what a
trainer or a replica calls between two denoising steps, each with a finite timeout. `DiffusionEngine` has them as
its own (it derives from `ControlMethods`); each delegates to the engine's `ControlCalls` (`engine/control.py`), which
runs it on the loop thread."""

from __future__ import annotations

from typing import Optional

from omniroll.engine.control import ControlCalls


class ControlMethods:
    """`DiffusionEngine`'s control calls, documented where a user reads them; `self.controls` runs them."""

    controls: ControlCalls

    def pause_generation(self, after_steps: int = 0, timeout_s: float = 300.0) -> dict:
        """Run `after_steps` more denoising steps (0: none), then pause until `resume_generation()`, or until
        `timeout_s` after the pause began (nothing hangs). Samples in flight keep their state, new requests queue and
        control calls still run: a `partial=True` update sent while paused lands after exactly those steps. Returns
        once armed, with the pause's state and the step count (`wait_for_pause` waits for it to begin)."""
        return self.controls.pause_generation(after_steps, timeout_s)

    def wait_for_pause(self, timeout_s: float = 60.0) -> dict:
        """Block until the armed pause has begun; `{"paused", "steps", "running"}` (the ids in flight). TimeoutError
        if it has not begun within `timeout_s` (fewer steps ran than it waits for)."""
        return self.controls.wait_for_pause(timeout_s)

    def resume_generation(self, timeout_s: float = 60.0) -> dict:
        """End the pause, or disarm one that has not begun; `{"resumed": bool}`: whether generation was paused."""
        return self.controls.resume_generation(timeout_s)

    def set_weight_version(self, version: int, timeout_s: float = 60.0) -> dict:
        """Relabel the current weights: steps from now on record `version`, an int >= the current one (versions never
        go backwards); the weights do not change. `{"version": int}`."""
        return self.controls.set_weight_version(version, timeout_s)

    def update_weights_from_ipc(self, peft_config: Optional[dict] = None, base_sync_done: bool = False,
                                use_shm: bool = False, **kwargs) -> dict:
        """Apply one update, full weights or (with `peft_config`) a LoRA adapter, as a transaction between two steps.

        `WeightSender.send` calls it for you. Version, names, shapes and dtypes are checked from the manifest before
        anything is drained or aborted, values (finite) as they arrive; no step runs on a partly updated model and a
        rejected update changes nothing. Keywords: `manifest` and `buckets` (the stream), `version` (an int > the
        current one), `name_map`, `partial`, `drain_timeout_s` (10.0), `timeout_s` (600.0); `base_sync_done` is
        verl's flag (the base weights went out already), `use_shm` the `/dev/shm` transport.

        The samples in flight: with `partial=False` (the default) none spans two versions: running samples finish on
        the old weights for up to `drain_timeout_s`, what still runs then is aborted (acknowledged, re-run with its
        seed; `drain_timeout_s=None` waits for all of them, up to `timeout_s`). With `partial=True` nothing waits or
        is aborted: they continue from their latent with the new weights, each step recording its version.

        Returns the acknowledgement: `version`, `mode` (full or lora), what was received and how long it took, and the
        ids `aborted` (or `continued`). TimeoutError after `timeout_s`.
        """
        return self.controls.update_weights_from_ipc(peft_config, base_sync_done, use_shm, **kwargs)

    def add_lora(self, request, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                 timeout_s: float = 120.0) -> dict:
        """Load a LoRA adapter atomically between two steps (the previous one stays on any error): `request` is an
        `omniroll.weights.lora_format.OmniTensorLoRARequest` with in-memory `lora_tensors` and `peft_config`, or a PEFT
        directory (`lora_path`); one that binds no module of the denoiser is refused, naming the unmatched keys.
        `version`: what steps record from now on (None: unchanged); running samples are aborted after
        `drain_timeout_s`. `{"lora_name", "version", "aborted"}`."""
        return self.controls.add_lora(request, version, drain_timeout_s, timeout_s)

    def remove_lora(self, version: Optional[int] = None, drain_timeout_s: float = 10.0,
                    timeout_s: float = 120.0) -> dict:
        """Remove the LoRA adapter between two steps (the base model runs again); the arguments are `add_lora`'s.
        `{"removed": bool, "version", "aborted"}`."""
        return self.controls.remove_lora(version, drain_timeout_s, timeout_s)

    def sleep(self, level: int = 1, drain_timeout_s: float = 0.0, timeout_s: float = 120.0) -> dict:
        """Free the device. Level 1 moves every module to host memory; level 2 also drops the denoiser's weights (and
        its LoRA adapter): requests are refused until `wake_up()` and a full weight update. Running requests are
        aborted after `drain_timeout_s` (acknowledged); the prompt cache is cleared; sleeping at the current level or
        lower changes nothing. `{"level", "changed", "aborted"}` (and `removed_lora`)."""
        return self.controls.sleep(level, drain_timeout_s, timeout_s)

    def wake_up(self, timeout_s: float = 120.0) -> dict:
        """Bring the weights back to the device (a no-op when awake). Errors (out of memory) reach the caller, and a
        wake that does not finish within `timeout_s` raises TimeoutError instead of hanging.
        `{"awake": True, "changed", "needs_weight_sync"}` (after a level-2 sleep)."""
        return self.controls.wake_up(timeout_s)
