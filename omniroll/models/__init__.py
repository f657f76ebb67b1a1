"""Model adapters (one per diffusion family) and offline tiny checkpoints."""

from __future__ import annotations

import json
import os

import torch

from omniroll.models.base import Conditioning, DiffusionAdapter, stack_conditioning
from omniroll.models.flux import FluxAdapter
from omniroll.models.qwen_image import QwenImageAdapter
from omniroll.models.sd3 import SD3Adapter
from omniroll.models.tiny import FAMILIES, build_tiny, build_tiny_sd3
from omniroll.models.wan import WanAdapter

#: model_index.json `_class_name` -> adapter class
ADAPTERS: dict[str, type[DiffusionAdapter]] = {
    "StableDiffusion3Pipeline": SD3Adapter,
    "FluxPipeline": FluxAdapter,
    "QwenImagePipeline": QwenImageAdapter,
    "WanPipeline": WanAdapter,
}
#: the `--model` names that build a tiny random checkpoint ("tiny" is the SD3 one)
TINY_MODELS = {"tiny": "sd3", **{f"tiny-{f}": f for f in FAMILIES}}


def load_adapter(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DiffusionAdapter:
    """Load the adapter for a local diffusers checkpoint directory, chosen by model_index.json's `_class_name`."""
    path = os.fspath(path)
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"path {path!r} is not a diffusers checkpoint directory (no model_index.json)")
    try:
        with open(index) as f:
            class_name = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"cannot read _class_name from {index}: {e}") from e
    if class_name not in ADAPTERS:
        raise ValueError(
            f"unsupported pipeline _class_name {class_name!r} in {index}; supported: {sorted(ADAPTERS)}"
        )
    return ADAPTERS[class_name].from_pretrained(path, device=device, dtype=dtype)


def resolve_model(model: str, cache_dir: str | None = None) -> str:
    """A checkpoint directory for `model`: "tiny" (SD3) or "tiny-<family>" (sd3, flux, qwen-image, wan, wan2.2)
    builds (once, cached) that family's deterministic tiny checkpoint under `cache_dir` (default: $OMNIROLL_CACHE
    or .omniroll_cache); anything else must be a local diffusers checkpoint directory (nothing is downloaded)."""
    if model in TINY_MODELS:
        family = TINY_MODELS[model]
        root = cache_dir or os.environ.get("OMNIROLL_CACHE", ".omniroll_cache")
        return build_tiny(family, os.path.join(root, f"tiny-{family}"), seed=0)
    if not os.path.isfile(os.path.join(model, "model_index.json")):
        raise FileNotFoundError(f"model {model!r} is neither one of {sorted(TINY_MODELS)} nor a diffusers checkpoint "
                                "directory (no model_index.json); nothing is downloaded at run time")
    return model


__all__ = [
    "resolve_model",
    "ADAPTERS",
    "TINY_MODELS",
    "Conditioning",
    "DiffusionAdapter",
    "FluxAdapter",
    "QwenImageAdapter",
    "SD3Adapter",
    "WanAdapter",
    "build_tiny",
    "build_tiny_sd3",
    "load_adapter",
    "stack_conditioning",
]
