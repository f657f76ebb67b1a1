"""Tests' receiver of weight streams: :func:`apply_weight_update` (check, receive, commit in one call) and
:class:`ModuleReceiver`, a minimal in-process target without an engine (not part of omniroll's API). The engine splits
the three steps itself (``omniroll.engine.lifecycle``) so that it drains and aborts only once an update is known to be
complete.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omniroll.ray_nodes import this_node_id
from omniroll.weights.buckets import WeightManifest
from omniroll.weights.full import NameMap
from omniroll.weights.lora import LoRAManager
from omniroll.weights.staging import StagingPool
from omniroll.weights.transport import check_descriptor, transport_of
from omniroll.weights.update import check_version, prepare_update


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
    stage: bool = True,
    staging: StagingPool | None = None,
) -> dict:
    """Apply one update (full weights if ``peft_config`` is None, else a LoRA adapter) as a transaction.

    ``buckets`` is any transport's descriptor (see :func:`resolve_buckets`). Check (from the manifest), receive
    (values checked as they arrive), commit: see :mod:`omniroll.weights.update`. With the default ``stage=True`` a
    rejected or broken update leaves ``module`` untouched. Returns an ack dict: version, mode, num_tensors,
    num_bytes, num_buckets, seconds (+ lora fields).
    """
    check_descriptor(buckets, use_shm)
    update = prepare_update(module, lora_manager, manifest=manifest, peft_config=peft_config, name_map=name_map,
                            allow_partial=allow_partial, stage=stage, version=version, lora_name=lora_name,
                            lora_int_id=lora_int_id, load_inplace=load_inplace, staging=staging)
    update.receive(buckets, use_shm)
    return {**update.commit(), "version": version}


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
        self.staging = StagingPool()  # staged full updates reuse their staging tensors

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False, *, manifest, buckets,
                                version):
        """Same contract as the engine's: the version and the manifest are checked first, the update is staged,
        and a rejected or broken one changes nothing."""
        version = check_version(version, self.version)
        ack = apply_weight_update(self.module, self.lora_manager, manifest=manifest, buckets=buckets,
                                  peft_config=peft_config, use_shm=use_shm, name_map=self.name_map, version=version,
                                  staging=self.staging)
        self.version = version
        return {**ack, "node_id": this_node_id(), "transport": transport_of(buckets, use_shm)}

    def node_id(self) -> str | None:
        """The Ray node this receiver runs on (None outside Ray): the sender picks its transport from it."""
        return this_node_id()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def forward(self, **inputs) -> torch.Tensor:
        return self.module(**inputs).sample
