"""A LoRA adapter merged into its base layers' weights (`EngineConfig.merge_lora`), and unmerged exactly.

Unmerged, PEFT's LoRA layer runs the base layer and then the adapter's two small matmuls, a scale and an add: on the
shapes model (a rank-16 adapter on every linear of its transformer) the forward costs 1.35-1.55x the base model's on
2 CPU cores. Merged, each layer runs one matmul with W + B A * scaling, at the base model's cost.

`MergedLoRA.merge(module, adapter)` keeps each adapted layer's base weight (and bias) tensors and gives the layer
new ones, computed by PEFT's own `merge` (its safe form: the sum is built in a copy and a non-finite one raises
before the layer changes). `unmerge()` hands the kept tensors back to their parameters: never a subtraction, so the
base weights stay bitwise themselves however many versions are merged and unmerged. The cost: one more copy of the
adapted layers' weights while merged, on their device.

Merged and unmerged forwards agree to rounding, not bitwise (in fp32 on the shapes model, after its 10 steps: latents
within 1.5e-5 of their scale, a pixel at most one level of 255 apart; `benchmarks/lora_merge.py`): a trainer whose
loss takes the ratio of its recompute (the adapter unmerged) to the rollout's log-probs must not roll out merged.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from torch import nn


class MergedLoRA:
    """The base tensors of the layers one adapter is merged into (empty: nothing merged)."""

    def __init__(self):
        self._kept: list[tuple[LoraLayer, torch.Tensor, torch.Tensor | None]] = []  # (layer, weight, bias)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def merge(self, module: nn.Module, adapter: str) -> int:
        """Merge `adapter` into every layer of `module` that holds it; returns the number of layers. On any error
        the layers already merged are unmerged and the error raised: the adapter then runs unmerged."""
        if self._kept:
            raise RuntimeError("merge(): an adapter is already merged; unmerge() first")
        try:
            for layer in module.modules():
                if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
                    continue
                base = layer.get_base_layer()
                bias = base.bias.data if getattr(base, "bias", None) is not None else None
                self._kept.append((layer, base.weight.data, bias))
                with torch.no_grad():
                    layer.merge(safe_merge=True, adapter_names=[adapter])  # new tensors; the kept ones untouched
        except Exception:
            self.unmerge()
            raise
        return len(self._kept)

    def unmerge(self) -> None:
        """The kept base tensors back into their layers (the same tensors, not a copy); the layers run unmerged."""
        for layer, weight, bias in reversed(self._kept):
            base = layer.get_base_layer()
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            layer.merged_adapters.clear()
        self._kept = []
