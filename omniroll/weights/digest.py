"""A digest of the weights a model computes with: every component's parameters and buffers, a merged LoRA adapter
counted in the base layers it was merged into.

Two models with the same digest compute with the same bits. The names are read as PEFT leaves them without its
wrapper (`to_q.base_layer.weight` is `to_q.weight`), and a layer that holds its adapter merged (PEFT's
`LoraLayer.merged`) contributes its base weights only, so a merged adapter whose update is exactly zero (a fresh
LoRA, `B = 0`) gives the base model's digest; an adapter's own tensors count only where it runs unmerged. The cost is
one pass over the weights (a few milliseconds for the shapes model; for weights on a GPU, a copy to the host).
"""

from __future__ import annotations

import hashlib

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

#: the parts of a PEFT LoRA layer's state-dict names that belong to the adapter, not to the base layer
LORA_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})


def weights_digest(modules: dict[str, nn.Module]) -> str:
    """sha256 (hex) over every tensor of `modules` ({component name: module}) in name order: the component, the
    tensor's name, dtype, shape and bytes; the adapter tensors of a layer that holds its adapter merged (which its
    forward does not read) left out."""
    h = hashlib.sha256()
    for component in sorted(modules):
        merged = {n for n, m in modules[component].named_modules() if isinstance(m, LoraLayer) and m.merged}
        tensors = {}
        for name, tensor in modules[component].state_dict().items():
            parts = name.split(".")
            adapter_part = next((i for i, p in enumerate(parts) if p in LORA_PARTS), None)
            if adapter_part is not None and ".".join(parts[:adapter_part]) in merged:  # the layer owning the tensor
                continue
            tensors[".".join(p for p in parts if p != "base_layer")] = tensor
        for name in sorted(tensors):
            t = tensors[name].detach()
            h.update(f"{component}.{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}\n".encode())
            h.update(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
