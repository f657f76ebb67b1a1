"""Exporting a trainer checkpoint for diffusers: a LoRA as the family pipeline's own LoRA file
(`pytorch_lora_weights.safetensors`, what `pipe.load_lora_weights(dir)` loads), or a whole pipeline directory with the
trained weights in its transformer (`--merge`: what `DiffusionPipeline.from_pretrained(dir)` loads).

Every file is written by diffusers' and PEFT's own helpers: the LoRA goes through PEFT onto the base transformer
(which checks its keys and shapes against the base model), comes back out with `get_peft_model_state_dict`, and is
written by `<Pipeline>.save_lora_weights` with its `LoraConfig` as metadata (so `lora_alpha / r` survives); a merge
loads that file into the base pipeline, `fuse_lora`s it and `save_pretrained`s the pipeline. Everything is written
into a temporary directory beside the target, renamed onto it at the end: the target holds a whole export or nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

from omniroll.engine.params import DTYPE_NAMES
from omniroll.files import staged_directory

#: the file diffusers' `save_lora_weights` writes and `load_lora_weights(dir)` reads
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class ExportSource:
    """What an export reads: the checkpoint directory, its kind ("lora" or "full"), the base model directory it
    applies to, and that model's pipeline class name."""

    checkpoint: str
    kind: str
    model_dir: str
    pipeline_class: str


def export_source(path: str, model: Optional[str] = None) -> ExportSource:
    """The checkpoint at `path` (a checkpoint directory, or a run directory: its latest) and the base model it
    applies to (`model`, else the `engine.model` the run was trained on). FileNotFoundError / ValueError naming the
    argument (CKPT, --model) and what is wrong."""
    from omniroll.evaluation.checkpoints import checkpoint_kind
    from omniroll.models import ADAPTERS, pipeline_class_name, resolve_model
    from omniroll.models.checkpoint import read_model_index
    from omniroll.train.checkpoint import find_checkpoint, read_trainer_state

    ckpt = find_checkpoint(path, flag="CKPT")
    try:
        kind = checkpoint_kind(ckpt)
    except ValueError as e:
        raise ValueError(f"CKPT {e}") from None
    if model is None:
        state = read_trainer_state(ckpt, flag="CKPT")
        model = ((state.get("config") or {}).get("engine") or {}).get("model")
        if not isinstance(model, str):
            raise ValueError(f"CKPT {ckpt}: its trainer_state.pt names no engine.model; pass --model")
        what = f"--model (default: the checkpoint's engine.model {model!r})"
    else:
        what = "--model"
    try:
        model_dir = resolve_model(model)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what}: {e}") from None
    class_name = pipeline_class_name(model_dir)
    if class_name not in ADAPTERS:
        raise ValueError(f"{what}: pipeline {class_name!r} is not one omniroll exports; supported: {sorted(ADAPTERS)}")
    second = (read_model_index(model_dir).get("transformer_2") or [None])[0]
    if second is not None:  # Wan 2.2 A14B: two denoisers, and a LoRA file names one
        raise ValueError(f"{what}: {class_name} with two denoisers (transformer_2) is not supported by export")
    return ExportSource(ckpt, kind, model_dir, class_name)


def check_target(to: str) -> None:
    """`to` must be absent or an empty directory (an export never overwrites files); ValueError naming --to."""
    if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
        what = "a directory that is not empty" if os.path.isdir(to) else "a file"
        raise ValueError(f"--to {to}: exists and is {what}; give a new or empty directory (an export never "
                         f"overwrites)")


def export_checkpoint(source: ExportSource, to: str, merge: bool = False, dtype: str = "float32") -> list[str]:
    """Write `source` as a diffusers LoRA directory (`merge` False: LoRA checkpoints only) or a merged pipeline
    directory (`merge` True) at `to`, atomically; returns the files written (relative to `to`)."""
    import torch

    if dtype not in DTYPE_NAMES:  # the dtypes a model computes in
        raise ValueError(f"--dtype must be one of {list(DTYPE_NAMES)}, got {dtype!r}")
    if source.kind == "full" and not merge:
        raise ValueError(f"CKPT {source.checkpoint}: a full-weight checkpoint has no LoRA to export; use --merge "
                         f"(a whole pipeline directory with those weights)")
    check_target(to)
    to = os.path.abspath(to)
    with staged_directory(to, prefix=".tmp-export-") as tmp:  # `to` holds a whole export or nothing
        torch_dtype = getattr(torch, dtype)
        if merge:
            write_merged(source, tmp, torch_dtype)
        else:
            write_lora(source, tmp, torch_dtype)
        check_target(to)  # nothing appeared there meanwhile (an empty directory is replaced)
    return sorted(os.path.relpath(os.path.join(d, f), to) for d, _, files in os.walk(to) for f in files)


# ----------------------------------------------------------------------------------------------- the LoRA file
def read_lora(ckpt: str):
    """A LoRA checkpoint's `LoraConfig` and its tensors keyed `<module>.lora_A.weight` / `.lora_B.weight`."""
    from omniroll.weights import lora_config_from_dict, normalize_lora_keys
    from omniroll.weights import load_lora_dir

    config, tensors = load_lora_dir(ckpt)
    return lora_config_from_dict(config), normalize_lora_keys(tensors)


def lora_problems(transformer, tensors: dict) -> list[str]:
    """Where the LoRA tensors do not fit `transformer` (a module they name that it lacks, or a shape its layer cannot
    take): one line each, at most five."""
    import torch

    modules = dict(transformer.named_modules())
    out = []
    for key, t in sorted(tensors.items()):
        name, _, part = key.removesuffix(".weight").rpartition(".")
        layer = modules.get(name)
        if not isinstance(layer, torch.nn.Linear):
            out.append(f"{key}: the base model has no linear layer {name!r}")
            continue
        want = (layer.in_features if part == "lora_A" else layer.out_features)
        got = t.shape[1] if part == "lora_A" else t.shape[0]
        if t.dim() != 2 or got != want:
            side = "in" if part == "lora_A" else "out"
            out.append(f"{key}: shape {tuple(t.shape)} does not fit {name} ({side}_features {want})")
    return out[:5] + ([f"... and {len(out) - 5} more"] if len(out) > 5 else [])


def base_transformer(source: ExportSource, torch_dtype):
    """The base model's transformer alone (the class model_index.json names), loaded offline."""
    import diffusers

    from omniroll.models.checkpoint import read_model_index

    _, class_name = read_model_index(source.model_dir)["transformer"]
    return getattr(diffusers, class_name).from_pretrained(source.model_dir, subfolder="transformer",
                                                          local_files_only=True, torch_dtype=torch_dtype)


def write_lora(source: ExportSource, out: str, torch_dtype) -> None:
    """`out`/pytorch_lora_weights.safetensors: the checkpoint's LoRA, checked against the base transformer through
    PEFT, written by the family pipeline's `save_lora_weights` with its LoraConfig as metadata."""
    import diffusers
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    from omniroll.weights import peft_config_to_dict

    config, tensors = read_lora(source.checkpoint)
    transformer = base_transformer(source, torch_dtype)
    problems = lora_problems(transformer, tensors)
    if problems:
        raise ValueError("\n".join([f"CKPT {source.checkpoint}: its LoRA does not fit the base model "
                                     f"{source.model_dir} (trained on another model? pass --model):", *problems]))
    transformer.add_adapter(config)
    loaded = set_peft_model_state_dict(transformer, {k: v.to(torch_dtype) for k, v in tensors.items()},
                                       adapter_name="default")
    missing = [k for k in loaded.missing_keys if "lora_" in k]
    if missing or loaded.unexpected_keys:
        raise ValueError(f"CKPT {source.checkpoint}: its LoRA tensors do not match its adapter_config.json "
                         f"(missing {missing[:3]}, unexpected {list(loaded.unexpected_keys)[:3]})")
    layers = get_peft_model_state_dict(transformer, adapter_name="default")
    pipeline = getattr(diffusers, source.pipeline_class)
    pipeline.save_lora_weights(out, transformer_lora_layers=layers, weight_name=LORA_WEIGHT_NAME,
                               transformer_lora_adapter_metadata=peft_config_to_dict(config))


# ----------------------------------------------------------------------------------------------- the merged pipeline
def write_merged(source: ExportSource, out: str, torch_dtype) -> None:
    """`out`: the base pipeline (`save_pretrained`) with the checkpoint's weights in its transformer: a LoRA fused by
    diffusers (`load_lora_weights` of the exported file, `fuse_lora`, `unload_lora_weights`), full weights copied in;
    the base model's `omniroll_defaults.json` (its sampling defaults) copied beside."""
    from omniroll.evaluation.checkpoints import load_full_weights
    from omniroll.models import load_adapter
    from omniroll.models.checkpoint import SAMPLING_DEFAULTS_FILE

    adapter = load_adapter(source.model_dir, dtype=torch_dtype)
    pipe = adapter.pipeline
    if source.kind == "full":
        try:
            load_full_weights(adapter, source.checkpoint)
        except ValueError as e:
            raise ValueError(f"CKPT {e}; pass --model") from None
    else:
        lora_dir = tempfile.mkdtemp(prefix=".tmp-lora-", dir=out)
        try:
            write_lora(source, lora_dir, torch_dtype)
            pipe.load_lora_weights(lora_dir, weight_name=LORA_WEIGHT_NAME, adapter_name="export")
            pipe.fuse_lora(components=["transformer"], lora_scale=1.0, adapter_names=["export"])
            pipe.unload_lora_weights()
        finally:
            shutil.rmtree(lora_dir, ignore_errors=True)
    pipe.save_pretrained(out, safe_serialization=True)
    defaults = os.path.join(source.model_dir, SAMPLING_DEFAULTS_FILE)
    if os.path.isfile(defaults):
        shutil.copyfile(defaults, os.path.join(out, SAMPLING_DEFAULTS_FILE))
