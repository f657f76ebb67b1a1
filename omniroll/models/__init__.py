"""Model adapters (one per diffusion family) and offline tiny checkpoints."""

from __future__ import annotations

import os

import torch

from omniroll.models.base import Conditioning, DiffusionAdapter, stack_conditioning
from omniroll.models.checkpoint import (DEFAULT_TASK, INDEX_FILE, ModelLimits, pipeline_class_name,
                                        read_sampling_defaults, read_task, require_checkpoint)
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
#: the `--model` names of checkpoints shipped with the package
SHIPPED_MODELS = ("shapes", "shapes-video")


def load_adapter(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DiffusionAdapter:
    """Load the adapter for a local diffusers checkpoint directory, chosen by model_index.json's `_class_name`."""
    path = os.fspath(path)
    class_name = pipeline_class_name(path)
    if class_name not in ADAPTERS:
        raise ValueError(f"unsupported pipeline _class_name {class_name!r} in {os.path.join(path, INDEX_FILE)}; "
                         f"supported: {sorted(ADAPTERS)}")
    return ADAPTERS[class_name].from_pretrained(path, device=device, dtype=dtype)


def resolve_model(model: str, cache_dir: str | None = None) -> str:
    """A checkpoint directory for `model`: "shapes" is the shipped shapes model (`omniroll.models.shapes`),
    "shapes-video" the shipped shapes-video model (`omniroll.models.shapes_video`; FileNotFoundError saying how to
    make it while none is shipped); "tiny"
    (SD3) or "tiny-<family>" (sd3, flux, qwen-image, wan, wan2.2) builds (once, cached) that family's deterministic
    tiny checkpoint under `cache_dir` (default: $OMNIROLL_CACHE or .omniroll_cache); anything else must be a local
    diffusers checkpoint directory (nothing is downloaded)."""
    if model == "shapes":
        from omniroll.models.shapes import checkpoint_dir

        return checkpoint_dir()
    if model == "shapes-video":
        from omniroll.models import shapes_video

        return shapes_video.checkpoint_dir()
    if model in TINY_MODELS:
        family = TINY_MODELS[model]
        from omniroll.files import tiny_model_cache_dir

        root = cache_dir or tiny_model_cache_dir()
        return build_tiny(family, os.path.join(root, f"tiny-{family}"), seed=0)
    if not os.path.isfile(os.path.join(model, INDEX_FILE)):
        if _looks_like_hub_id(model):
            raise FileNotFoundError(
                f"model {model!r} looks like a Hugging Face hub id, and omniroll loads local checkpoints only "
                f"(nothing is downloaded at run time). Download it first, e.g. "
                f"`hf download {model} --local-dir checkpoints/{model.split('/')[-1]}` (gated models need "
                f"`hf auth login` and an accepted license), then pass that directory as the model")
        raise FileNotFoundError(f"model {model!r} is neither one of {[*SHIPPED_MODELS, *sorted(TINY_MODELS)]} nor a "
                                f"diffusers checkpoint directory (no {INDEX_FILE}); nothing is downloaded at run time")
    return model


def _looks_like_hub_id(model: str) -> bool:
    """`org/name` with no such local directory (a hub repository id, not a path)."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and not os.path.exists(model)
            and all(c.isalnum() or c in "-_." for c in model.replace("/", "")))


def model_limits(model: str) -> ModelLimits | None:
    """The limits of `model` (a tiny name, a shipped name or a checkpoint directory) from files or constants alone:
    nothing is built or loaded."""
    if model in TINY_MODELS:
        from omniroll.models.tiny import TINY_LIMITS

        return ModelLimits(*TINY_LIMITS[TINY_MODELS[model]])
    return read_limits(resolve_model(model))


def read_limits(path: str) -> ModelLimits | None:
    """The limits (resolution multiple and maximum, text length) of the checkpoint at `path`, from its config files
    alone (no weights are loaded): the family adapter's `limits_from_files`; None when the family cannot say."""
    class_name = pipeline_class_name(path)
    adapter = ADAPTERS.get(class_name)
    if adapter is None:
        raise ValueError(f"unsupported pipeline _class_name {class_name!r} in {os.path.join(path, INDEX_FILE)}; "
                         f"supported: {sorted(ADAPTERS)}")
    return adapter.limits_from_files(path)


def prompt_ids_length(model: str) -> int | None:
    """The number of prompt token ids `model` (a tiny name or a checkpoint directory) reports per prompt, from its
    files (nothing is loaded or built); None when unknown or not fixed. `prompt_length` must be at least this."""
    if model in TINY_MODELS:
        from omniroll.models.tiny import CLIP_MAX_LENGTH

        return CLIP_MAX_LENGTH if TINY_MODELS[model] in ("sd3", "flux") else None
    try:
        model = resolve_model(model) if model in SHIPPED_MODELS else model
        adapter = ADAPTERS.get(pipeline_class_name(model))
    except (FileNotFoundError, ValueError):
        return None
    return adapter.prompt_ids_length(model) if adapter is not None else None


def model_task(model: str) -> str:
    """The task world `model` (a name or a checkpoint directory) draws for (`read_task`): its checkpoint's
    `omniroll_defaults.json` task; the tiny models and a path that is not a checkpoint (the config reports those):
    the shapes world."""
    if model in TINY_MODELS:
        return DEFAULT_TASK
    try:
        return read_task(resolve_model(model))
    except FileNotFoundError:
        return DEFAULT_TASK


def sampling_defaults(model: str) -> dict:
    """The sampling defaults `model` (a name or a checkpoint directory) states (`read_sampling_defaults`); {} for
    the tiny models and for paths that are not checkpoints (the config reports those)."""
    if model in TINY_MODELS:
        return {}
    try:
        return read_sampling_defaults(resolve_model(model))
    except FileNotFoundError:
        return {}


__all__ = [
    "model_task",
    "prompt_ids_length",
    "resolve_model",
    "sampling_defaults",
    "SHIPPED_MODELS",
    "read_limits",
    "model_limits",
    "require_checkpoint",
    "ModelLimits",
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
