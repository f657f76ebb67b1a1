"""A LoRA adapter as it travels: the request that carries it, its config as a plain dict, its tensors' keys in one
form, and a saved PEFT adapter directory.

Accepted tensor keys (after :func:`normalize_lora_keys`):

* what ``peft.get_peft_model_state_dict`` produces for a PEFT-wrapped transformer, e.g.
  ``transformer_blocks.0.attn.to_q.lora_A.weight``, with or without any number of leading
  ``base_model.model.`` prefixes;
* the same keys with the adapter name still inside (``...to_q.lora_A.default.weight``,
  i.e. a raw ``module.state_dict()`` of an injected model);
* a leading ``transformer.`` (diffusers pipeline-level LoRA files), stripped when the
  target module has no child called ``transformer``.

Keys in kohya/``lora_down``/``lora_up`` formats are not accepted (they raise LoRABindError). The engine's side, which
binds them to a module, is `lora.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig
from peft.functional import get_peft_model_state_dict
from torch import nn

from .buckets import WeightSyncError

#: a normalised LoRA key: the module path, the LoRA parameter, an optional adapter name and suffix
LORA_PARAM = re.compile(r"^(?P<mod>.+)\.(?P<p>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                        r"(?:\.(?P<adapter>[^.]+))?(?:\.(?P<suffix>weight|bias))?$")


class LoRABindError(WeightSyncError):
    """LoRA tensors that do not bind to modules of the target (names listed in the message)."""

    def __init__(self, message: str, unmatched: list[str] | None = None):
        super().__init__(message)
        self.unmatched = list(unmatched or [])


@dataclass
class OmniTensorLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    peft_config: dict = None
    lora_tensors: dict = None


def peft_config_to_dict(cfg: Any) -> dict:
    """A JSON-friendly dict of a ``LoraConfig`` (sets -> sorted lists, enums -> str)."""
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    out = {}
    for k, v in d.items():
        if isinstance(v, (set, frozenset)):
            v = sorted(v)
        elif hasattr(v, "value") and not isinstance(v, (int, float, str)):
            v = v.value
        out[k] = v
    return out


def lora_config_from_dict(d: dict) -> LoraConfig:
    """Build a ``LoraConfig`` for inference from a config dict (unknown keys are ignored)."""
    if d is None:
        raise WeightSyncError("a LoRA update needs a peft_config")
    peft_type = str(d.get("peft_type", "LORA")).upper().replace("PEFTTYPE.", "")
    if peft_type != "LORA":
        raise WeightSyncError(f"only LoRA adapters are supported, got peft_type={d.get('peft_type')!r}")
    init = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    kw = {k: v for k, v in d.items() if k in init and k not in ("peft_type", "task_type", "auto_mapping")}
    kw["init_lora_weights"] = False  # never let an initialiser touch the base weights
    kw["inference_mode"] = True
    return LoraConfig(**kw)


def lora_state_dict(peft_model_or_module: nn.Module, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
    """Only the LoRA tensors of a PEFT model (or a module with injected adapters).

    Keys have no ``base_model.model.`` prefix and no adapter name:
    ``transformer_blocks.0.attn.to_q.lora_A.weight``. A container of adapted modules without a config of its own (a
    two-expert denoiser: a ModuleDict of transformers) gives each one's under its name: ``transformer_2.blocks...``.
    """
    m = peft_model_or_module
    if getattr(m, "peft_config", None) is None:
        adapted = [(n, c) for n, c in m.named_children() if getattr(c, "peft_config", None) is not None]
        if adapted:
            return {f"{n}.{k}": v for n, c in adapted for k, v in lora_state_dict(c, adapter_name).items()}
    if adapter_name is None:
        active = getattr(m, "active_adapter", None)
        adapter_name = active if isinstance(active, str) else "default"
    sd = get_peft_model_state_dict(m, adapter_name=adapter_name)
    return {_strip_prefix(k): v.detach() for k, v in sd.items()}


def _strip_prefix(k: str) -> str:
    while k.startswith("base_model.model."):
        k = k[len("base_model.model.") :]
    return k


def normalize_lora_keys(tensors: dict[str, torch.Tensor], module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Normalise keys to ``<module path>.lora_A.weight`` form (see module docstring)."""
    out: dict[str, torch.Tensor] = {}
    strip_transformer = module is not None and not hasattr(module, "transformer")
    for k, v in tensors.items():
        key = _strip_prefix(k)
        if strip_transformer and key.startswith("transformer."):
            key = key[len("transformer.") :]
        m = LORA_PARAM.match(key)
        if m:
            suffix = m.group("suffix")
            adapter = m.group("adapter")
            if adapter in ("weight", "bias") and suffix is None:
                suffix, adapter = adapter, None
            key = f"{m.group('mod')}.{m.group('p')}" + (f".{suffix}" if suffix else "")
        if key in out:
            raise LoRABindError(f"two LoRA tensors normalise to the same key {key!r}", [k])
        out[key] = v
    return out


def load_lora_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a saved PEFT adapter dir: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "adapter_config.json")
    st_path = os.path.join(path, "adapter_model.safetensors")
    missing = [p for p in (cfg_path, st_path) if not os.path.exists(p)]
    if missing:
        raise WeightSyncError(f"LoRA directory {path!r} lacks: {', '.join(missing)}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    return cfg, load_file(st_path)
