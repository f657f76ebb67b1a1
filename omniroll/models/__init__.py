"""Model adapters (one per diffusion family) and offline tiny checkpoints."""

from __future__ import annotations

import json
import os

import torch

from omniroll.models.base import Conditioning, DiffusionAdapter, stack_conditioning
from omniroll.models.sd3 import SD3Adapter
from omniroll.models.tiny import build_tiny_sd3

#: model_index.json `_class_name` -> adapter class
ADAPTERS: dict[str, type[DiffusionAdapter]] = {"StableDiffusion3Pipeline": SD3Adapter}


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
    """A checkpoint directory for `model`: "tiny" builds (once, cached) the deterministic tiny SD3 under `cache_dir`
    (default: $OMNIROLL_CACHE or .omniroll_cache); anything else must be a local diffusers checkpoint directory
    (nothing is downloaded at run time)."""
    if model == "tiny":
        root = cache_dir or os.environ.get("OMNIROLL_CACHE", ".omniroll_cache")
        return build_tiny_sd3(os.path.join(root, "tiny-sd3"), seed=0)
    if not os.path.isfile(os.path.join(model, "model_index.json")):
        raise FileNotFoundError(f"model {model!r} is neither 'tiny' nor a diffusers checkpoint directory "
                                "(no model_index.json); nothing is downloaded at run time")
    return model


def prompt_ids_length(model: str) -> int | None:
    """The number of prompt token ids `model` ("tiny" or a checkpoint directory) reports per prompt, from its files
    (nothing is loaded or built); None when unknown. `prompt_length` must be at least this."""
    if model == "tiny":
        from omniroll.models.tiny import CLIP_MAX_LENGTH

        return CLIP_MAX_LENGTH
    try:
        with open(os.path.join(model, "model_index.json")) as f:
            adapter = ADAPTERS.get(json.load(f).get("_class_name"))
    except (OSError, ValueError, AttributeError):
        return None
    return adapter.prompt_ids_length(model) if adapter is not None else None


__all__ = [
    "prompt_ids_length",
    "resolve_model",
    "ADAPTERS",
    "Conditioning",
    "DiffusionAdapter",
    "SD3Adapter",
    "build_tiny_sd3",
    "load_adapter",
    "stack_conditioning",
]
