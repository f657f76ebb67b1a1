"""The weights and memory state of one engine between its steps (`Lifecycle`: weight version, sleep level, LoRA
adapter, whether the weights can serve): a component the engine owns (`engine.lifecycle`); it holds no reference to
the engine. (The pause of generation after a chosen number of steps is `engine/step_pause.py`.)

State (explicit, nothing else):
  version        the weight version every step run now records (0: the checkpoint's weights)
  asleep_level   0 awake, 1 weights offloaded to host memory, 2 the denoiser's weights dropped
  unusable       None, or why the denoiser's weights cannot serve: dropped by sleep(level=2), or an in-place update
                 that failed midway. Cleared only by a complete full update.
  lora           the LoRAManager of the denoiser (built on first use); with merge_lora its active adapter is merged
                 into the base weights, which are handed back before a full update lands and before sleep moves them

Threads: `check_*`, `admission_error` and `prepare_update` only read state and may run on any thread (the engine
serialises lifecycle calls, so the state they read does not change under them); `commit_update`, `apply_in_place`,
`sleep`, `wake_up`, `add_lora` and `remove_lora` change the model and run on the engine thread between two steps,
with nothing running (the engine drained or aborted it first); `set_version` runs on the engine thread between two
steps.

Weight update mechanism (see `omniroll.weights.update`): every check that the manifest allows (version, names, shapes,
dtypes, LoRA binding) happens in `prepare_update`, before the engine drains or aborts anything. A full update is
staged by default (`EngineConfig.weight_update="staged"`): buckets are read and checked into a copy while the engine
keeps serving the old weights, and only a complete, finite update is copied in, between two steps (memory cost: one
extra copy of the denoiser, on its device, during the update; none when an in-process sender's tensors are on the
denoiser's device: they are checked while the engine serves and copied in at the commit). `weight_update="in_place"`
needs no extra memory: the engine stops serving first, writes bucket by bucket, and if the stream fails midway after a
byte landed, the weights are `unusable`: every request is refused with an error naming the failed version until a
complete full update lands. Weights that are already unusable (after sleep(level=2), the usual colocated RL flow) are
always written in place: nothing is served from them, so the staging copy would only cost memory. A LoRA update is
always staged; the previous adapter stays active on any failure.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from omniroll.engine.errors import EngineAsleepError, EngineError
from omniroll.models.base import DiffusionAdapter
from omniroll.weights import LoRAManager, OmniTensorLoRARequest, check_version, prepare_update
from omniroll.weights.staging import StagingPool
from omniroll.weights.transport import check_descriptor

__all__ = ["Lifecycle", "EngineAsleepError"]

SLEEP_LEVELS = (1, 2)


class Lifecycle:
    def __init__(self, adapter: DiffusionAdapter, device: str, weight_update: str = "staged",
                 merge_lora: bool = False):
        self.adapter = adapter
        self.merge_lora = merge_lora
        self.device = torch.device(device)
        self.stage = weight_update == "staged"
        self.version = 0
        self.asleep_level = 0
        self.unusable: Optional[str] = None
        self._dropped = False  # unusable because sleep(level=2) dropped the weights (an EngineAsleepError)
        self._lora: Optional[LoRAManager] = None
        self.staging = StagingPool()  # staged full updates reuse their staging tensors (dropped by sleep)

    @property
    def lora(self) -> LoRAManager:
        if self._lora is None:
            self._lora = LoRAManager(self.adapter.denoiser, merge=self.merge_lora)
        return self._lora

    @property
    def active_lora(self) -> Optional[str]:
        return self._lora.active_lora if self._lora is not None else None

    # ------------------------------------------------------------------ reads (any thread)
    @property
    def can_step(self) -> bool:
        return not self.asleep_level and self.unusable is None

    def admission_error(self, asleep_policy: str) -> Optional[EngineError]:
        """Why a new request cannot be accepted now (None: it can; with asleep_policy="wait" it waits for wake)."""
        if self.asleep_level and asleep_policy == "error":
            return EngineAsleepError(f"engine is asleep (level {self.asleep_level}); call wake_up() first")
        if not self.asleep_level and self.unusable is not None:
            return self.unusable_error()
        return None

    def unusable_error(self) -> EngineError:
        return (EngineAsleepError if self._dropped else EngineError)(self.unusable)

    def check_version(self, version: Any) -> int:
        return check_version(version, self.version)

    def prepare_update(self, manifest, peft_config: Optional[dict], version: Any, name_map, buckets, use_shm: bool):
        """Every check that needs no tensor value; raises before anything is touched. Returns the update."""
        version = self.check_version(version)
        check_descriptor(buckets, use_shm)
        if self.asleep_level:
            raise EngineAsleepError(f"engine is asleep (level {self.asleep_level}): call wake_up() before a weight "
                                    f"update; nothing applied")
        lora = self.lora if peft_config is not None else None
        # weights that cannot serve anyway (dropped by sleep(2), or a failed in-place update) are written in place:
        # nothing is served from them until a complete update lands, and no staging copy is needed
        stage = self.stage and self.unusable is None
        update = prepare_update(self.adapter.denoiser, lora, manifest=manifest, peft_config=peft_config,
                                name_map=name_map, stage=stage, version=version, staging=self.staging)
        update.version = version
        return update

    # ------------------------------------------------------------------ changes (engine thread, nothing running)
    def commit_update(self, update) -> dict:
        """Land a received update (staged: copy in; cannot leave a partial model). A full update lands into the base
        weights: a merged adapter is unmerged around it and merged into the new weights after."""
        if update.mode == "full" and self._lora is not None:
            self._lora.unmerge_weights()
        try:
            ack = update.commit()
        finally:
            if self._lora is not None:
                self._lora.merge_weights()
        self._landed(update)
        return {**ack, "version": update.version}

    def apply_in_place(self, update, buckets, use_shm: bool) -> dict:
        """Receive straight into the model; a failure after a byte landed marks the weights unusable."""
        if self._lora is not None:  # the buckets land in the base weights (a LoRA update is always staged)
            self._lora.unmerge_weights()
        try:
            update.receive(buckets, use_shm)
        except BaseException as e:
            if update.touched:
                self._dropped = False
                self.unusable = (f"weight update to version {update.version} failed midway ({e}); the model is "
                                 f"partly updated: a complete full update must land before generation resumes")
            if self._lora is not None:
                self._lora.merge_weights()
            raise
        return self.commit_update(update)

    def _landed(self, update) -> None:
        self.version = update.version
        if update.mode == "full":
            self.unusable, self._dropped = None, False

    def set_version(self, version: Any) -> dict:
        """Relabel the current weights (e.g. verl's set_global_steps after a sync): an int >= the current version
        (the same one is a no-op); versions never go backwards."""
        if version != self.version:
            self.version = self.check_version(version)
        return {"version": self.version}

    def add_lora(self, request: OmniTensorLoRARequest, version: Optional[int]) -> dict:
        self.lora.add_lora(request)  # atomic: the previous adapter stays on any error
        if version is not None:
            self.version = version
        return {"lora_name": request.lora_name, "version": self.version}

    def remove_lora(self, version: Optional[int]) -> dict:
        removed = self._lora.remove_lora() if self._lora is not None else False
        if version is not None:
            self.version = version
        return {"removed": removed, "version": self.version}

    def sleep(self, level: int) -> dict:
        """Free the device. level 1: every module moves to host memory. level 2: the denoiser's weights are dropped
        (and its LoRA adapter removed: a full update, then the adapter, must be sent again); text encoders and VAE
        are offloaded as in level 1. Never makes the engine less asleep: sleep(1) at level 2 stays at level 2."""
        if level <= self.asleep_level:
            return {"level": self.asleep_level, "changed": False}
        self.staging.clear()  # the kept staging copy would hold device memory through the sleep
        removed_lora = None
        if self._lora is not None:  # the base weights move (or go), not a merged copy beside them
            self._lora.unmerge_weights()
        if level == 2 and self.active_lora is not None:
            removed_lora = self.active_lora
            self._lora.remove_lora()
        for module in self.adapter.modules().values():
            if level == 2 and module is self.adapter.denoiser:
                module.to_empty(device="meta")
            elif not any(p.is_meta for p in module.parameters()):
                module.to("cpu")
        if level == 2:
            self.unusable = "weights were dropped by sleep(level=2): a full weight sync must come first"
            self._dropped = True
        self.asleep_level = level
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"level": level, "changed": True, **({"removed_lora": removed_lora} if removed_lora else {})}

    def wake_up(self) -> dict:
        """Weights back to the device; after level 2 the denoiser gets fresh storage that a full update must fill."""
        if self.asleep_level:
            for module in self.adapter.modules().values():
                if any(p.is_meta for p in module.parameters()):
                    module.to_empty(device=self.device)
                else:
                    module.to(self.device)
            if self._lora is not None:
                self._lora.merge_weights()
        changed, self.asleep_level = bool(self.asleep_level), 0
        return {"awake": True, "changed": changed, "needs_weight_sync": self.unusable is not None}
