"""One weight update as a transaction: check, receive, commit.

    update = prepare_update(module, lora_manager, manifest=..., peft_config=...)  # 1. checks; raises, touches nothing
    update.receive(buckets, use_shm)                                           # 2. reads and checks every value
    ack = update.commit()                                                      # 3. lands it (cannot fail)

1. :func:`prepare_update` checks everything the manifest tells before a byte is read: names (after ``name_map``),
   shapes and dtypes against the module (full), or the config, the binding of every key and the shapes (LoRA).
2. :meth:`receive` reads every bucket: each bucket must match the manifest, every floating tensor must be finite
   (a NaN / Inf rejects the whole update, naming the tensor), and every manifest name must arrive.
3. :meth:`commit` writes the module.

A full update is staged by default (``stage=True``): step 2 fills a copy (or, for an in-process bucket on the
parameter's device, checks and keeps the sender's tensors) and step 3 lands it, so a failure in 1 or 2 leaves the
module untouched; memory cost: one extra copy of the updated tensors (the module's size for a full update) until the
commit, none for in-process buckets (see :mod:`omniroll.weights.full`). With ``stage=False`` step 2 writes in place
(no extra memory) and a failure midway leaves the module partly written (``update.touched``): the caller must stop
serving it until a complete update lands. A LoRA update is always staged (its tensors are small): the previous adapter
stays active on any failure.

:func:`check_version` is the one rule for weight versions: an int (not a bool), strictly greater than the current one.
"""

from __future__ import annotations

import numbers
import time
from typing import Any

import torch
from torch import nn

from .buckets import WeightManifest, WeightSyncError, nonfinite, str_dtype, unpack_bucket
from .full import FullWeightLoader, NameMap, name_list
from .lora import LoRAManager
from .lora_format import OmniTensorLoRARequest
from .staging import StagingPool
from .transport import resolve_buckets


def check_version(version: Any, current: int) -> int:
    """The version a new update may carry: an int strictly greater than ``current``.

    A retry of the version that already landed is refused (the weights it names are already there, or are not the
    ones being sent); an update that failed changed nothing, so it may be retried under the same version."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise WeightSyncError(f"version must be an int (the trainer's step), got {type(version).__name__} "
                              f"{version!r}; nothing applied")
    if int(version) <= current:
        raise WeightSyncError(f"version must be > the current weight version {current}, got {int(version)} "
                              f"(versions never go backwards; a version that already landed is not re-applied); "
                              f"nothing applied")
    return int(version)


def prepare_update(module: nn.Module, lora_manager: LoRAManager | None, *, manifest: Any, peft_config: dict | None,
                   name_map: NameMap | None = None, allow_partial: bool = False, stage: bool = True,
                   version: int | None = None, lora_name: str | None = None, lora_int_id: int | None = None,
                   load_inplace: bool = True, staging: StagingPool | None = None) -> "FullUpdate | LoRAUpdate":
    """Check an update against ``module`` from its manifest alone; returns the update, ready to receive.
    ``staging``: the receiver's :class:`StagingPool` (a staged full update reuses its tensors across updates)."""
    if not isinstance(manifest, WeightManifest):
        manifest = WeightManifest(list(manifest))
    if peft_config is None:
        return FullUpdate(module, manifest, name_map, allow_partial=allow_partial, stage=stage, staging=staging)
    if lora_manager is None:
        raise WeightSyncError("a LoRA update needs a LoRAManager")
    return LoRAUpdate(lora_manager, manifest, peft_config, version, lora_name, lora_int_id, load_inplace)


class FullUpdate:
    mode = "full"

    def __init__(self, module: nn.Module, manifest: WeightManifest, name_map: NameMap | None, *,
                 allow_partial: bool, stage: bool, staging: StagingPool | None = None):
        self.loader = FullWeightLoader(module, name_map, allow_partial=allow_partial, stage=stage, staging=staging)
        self.loader.begin(manifest)
        self.stats: dict | None = None
        self.num_buckets = 0
        self.seconds = 0.0

    @property
    def staged(self) -> bool:
        return self.loader.stage

    @property
    def touched(self) -> bool:
        """Whether the module was written before the update completed (in place only)."""
        return self.loader.touched

    def receive(self, buckets: Any, use_shm: bool) -> None:
        t0 = time.perf_counter()
        it = resolve_buckets(buckets, use_shm)
        try:
            for b in it:
                self.loader.load_bucket(b)
                self.num_buckets += 1
                del b
        finally:
            it.close()
        self.stats = self.loader.check_complete()
        self.seconds += time.perf_counter() - t0

    def commit(self) -> dict:
        if self.stats is None:
            raise WeightSyncError("commit() before a complete receive()")
        t0 = time.perf_counter()
        self.loader.commit()
        self.seconds += time.perf_counter() - t0
        return {"mode": "full", **self.stats, "num_buckets": self.num_buckets, "seconds": self.seconds}


class LoRAUpdate:
    mode = "lora"
    staged = True
    touched = False

    def __init__(self, manager: LoRAManager, manifest: WeightManifest, peft_config: dict, version: int | None,
                 lora_name: str | None, lora_int_id: int | None, load_inplace: bool):
        dup = sorted({n for n in manifest.names if manifest.names.count(n) > 1})
        if dup:
            raise WeightSyncError(f"LoRA update rejected, nothing applied: duplicate name(s) {name_list(dup)}")
        not_float = [f"{e.name} ({e.dtype})" for e in manifest.entries if not str_dtype(e.dtype).is_floating_point]
        if not_float:
            raise WeightSyncError(f"LoRA update rejected, nothing applied: non-floating dtype for "
                                  f"{name_list(not_float)}")
        manager.check_update(peft_config, {e.name: tuple(e.shape) for e in manifest.entries})
        self.manager = manager
        self.manifest = {e.name: e for e in manifest.entries}
        vid = int(version) if version is not None else 1
        self.request = OmniTensorLoRARequest(
            lora_name=lora_name or f"lora-v{vid}", lora_int_id=int(lora_int_id) if lora_int_id is not None else vid,
            peft_config=dict(peft_config), lora_tensors=None, load_inplace=load_inplace)
        self.num_buckets = 0
        self.seconds = 0.0

    def receive(self, buckets: Any, use_shm: bool) -> None:
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        it = resolve_buckets(buckets, use_shm)
        try:
            for b in it:
                views = unpack_bucket(b)
                for name, t in views:
                    m = self.manifest.get(name)
                    if m is None or name in tensors:
                        why = "not in the manifest" if m is None else "received twice"
                        raise WeightSyncError(f"LoRA update rejected: tensor {name!r} {why} (bucket {b.index})")
                    if str_dtype(m.dtype) != t.dtype or tuple(m.shape) != tuple(t.shape):
                        raise WeightSyncError(f"LoRA update rejected: tensor {name!r} in bucket {b.index} is "
                                              f"{t.dtype}{tuple(t.shape)}, the manifest says {m.dtype}{tuple(m.shape)}")
                    tensors[name] = t  # cloned below, once the bucket's values are checked
                bad = nonfinite([t for _, t in views])
                if bad:
                    raise WeightSyncError(f"LoRA update rejected: non-finite values (NaN or Inf) in tensor(s) "
                                          f"{name_list([views[i][0] for i in bad])} (bucket {b.index})")
                for name, t in views:
                    tensors[name] = t.clone()  # the bucket buffer may be a reused / read-only slot
                self.num_buckets += 1
                del b
        finally:
            it.close()
        missing = sorted(set(self.manifest) - set(tensors))
        if missing:
            raise WeightSyncError(f"LoRA update incomplete: {len(missing)} manifest name(s) never received: "
                                  f"{name_list(missing)}")
        self.request.lora_tensors = tensors
        self.seconds += time.perf_counter() - t0

    def commit(self) -> dict:
        """Swap the adapter in (atomic: on any error the previous adapter stays active)."""
        if self.request.lora_tensors is None:
            raise WeightSyncError("commit() before a complete receive()")
        t0 = time.perf_counter()
        self.manager.add_lora(self.request)
        self.seconds += time.perf_counter() - t0
        tensors = self.request.lora_tensors
        return {"mode": "lora", "num_tensors": len(tensors),
                "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "lora_name": self.request.lora_name, "lora_int_id": self.request.lora_int_id,
                "num_buckets": self.num_buckets, "seconds": self.seconds}
