"""Receiver-side glue: what an engine's ``update_weights_from_ipc`` calls while paused.

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False,
                                *, manifest, buckets, version):
        self.pause()
        try:
            return apply_weight_update(self.transformer, self.lora_manager, manifest=manifest,
                                       buckets=buckets, peft_config=peft_config,
                                       use_shm=use_shm, version=version)
        finally:
            self.resume()
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .buckets import WeightManifest, WeightSyncError, unpack_bucket
from .full import FullWeightLoader, NameMap
from .lora import LoRAManager, OmniTensorLoRARequest
from .transport import resolve_buckets


def apply_weight_update(
    module: nn.Module,
    lora_manager: LoRAManager | None,
    *,
    manifest: WeightManifest,
    buckets: Any,
    peft_config: dict | None,
    use_shm: bool,
    name_map: NameMap | None = None,
    version: int | None = None,
    allow_partial: bool = False,
    lora_name: str | None = None,
    lora_int_id: int | None = None,
    load_inplace: bool = True,
) -> dict:
    """Apply one update (full weights if ``peft_config`` is None, else a LoRA adapter).

    ``buckets`` is any transport's descriptor (see :func:`resolve_buckets`).  Full path: the
    manifest is validated against ``module`` before the first bucket is read, then buckets
    are copied in place one at a time.  LoRA path: all buckets are accumulated (copied out,
    LoRA tensors are small) and ``lora_manager.add_lora`` is called once (with
    ``load_inplace``: same-structure adapters are updated in place, see LoRAManager).  Returns an ack
    dict: version, mode, num_tensors, num_bytes, num_buckets, seconds (+ lora fields).
    """
    t0 = time.perf_counter()
    if not isinstance(manifest, WeightManifest):
        manifest = WeightManifest(list(manifest))
    it = resolve_buckets(buckets, use_shm)
    nb = 0
    try:
        if peft_config is None:
            loader = FullWeightLoader(module, name_map, allow_partial=allow_partial)
            loader.begin(manifest)
            for b in it:
                loader.load_bucket(b)
                nb += 1
                del b
            ack = {"mode": "full", **loader.finish()}
        else:
            if lora_manager is None:
                raise WeightSyncError("a LoRA update needs a LoRAManager")
            tensors: dict[str, torch.Tensor] = {}
            dup = []
            for b in it:
                for name, t in unpack_bucket(b):
                    if name in tensors:
                        dup.append(name)
                    tensors[name] = t.clone()  # the bucket buffer may be a reused / read-only slot
                nb += 1
                del b
            expected = set(manifest.names)
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            if dup or missing or extra:
                raise WeightSyncError(f"LoRA update inconsistent with its manifest: duplicate={dup[:20]} "
                                      f"missing={missing[:20]} not-in-manifest={extra[:20]}")
            vid = int(version) if version is not None else 1
            req = OmniTensorLoRARequest(
                lora_name=lora_name or f"lora-v{vid}",
                lora_int_id=int(lora_int_id) if lora_int_id is not None else vid,
                peft_config=dict(peft_config),
                lora_tensors=tensors,
                load_inplace=load_inplace,
            )
            lora_manager.add_lora(req)
            ack = {"mode": "lora", "num_tensors": len(tensors),
                   "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                   "lora_name": req.lora_name, "lora_int_id": req.lora_int_id}
    finally:
        it.close()
    ack.update(version=version, num_buckets=nb, seconds=time.perf_counter() - t0)
    return ack


class ModuleReceiver:
    """A minimal in-process target that owns ``module`` (tests, single-process setups).

    Implements the ``update_weights_from_ipc`` contract the sender talks to; wrap it with
    ``ray.remote`` to get an actor target.
    """

    def __init__(self, module: nn.Module, name_map: NameMap | None = None):
        self.module = module
        self.lora_manager = LoRAManager(module)
        self.name_map = name_map
        self.version = 0

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False, *, manifest, buckets,
                                version):
        ack = apply_weight_update(self.module, self.lora_manager, manifest=manifest, buckets=buckets,
                                  peft_config=peft_config, use_shm=use_shm, name_map=self.name_map, version=version)
        self.version = version
        return ack

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def forward(self, **inputs) -> torch.Tensor:
        return self.module(**inputs).sample
