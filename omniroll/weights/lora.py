"""LoRA hot-swap on a plain (un-wrapped) transformer, through PEFT's functional API (the keys, configs and requests
it takes: `lora_format.py`).

:meth:`LoRAManager.add_lora` is atomic: the new adapter is injected next to the active one
under a fresh name, loaded and checked; only then is it activated and the old one removed.
With ``request.load_inplace`` and an active adapter of identical config, keys and shapes
(the usual case between RL steps) the tensors are copied into the live LoRA parameters
instead (no re-injection; all checks happen before the first copy).
Injected LoRA layers are put in eval mode (their ``lora_dropout`` is inactive: the same request and seed give the same
pixels), and the adapter computes in ``adapter_dtype``: by default the dtype of the tensors the trainer sent, so both
sides compute the adapter in the same dtype (PEFT injects adapters in the base layer's dtype, which for a bf16 engine
and an fp32 trainer adapter is 1e-4 off from the first sync; PEFT's LoRA forward casts the input to the adapter's dtype
and the sum back to the base layer's).
On any error the new adapter is deleted, wrappers left empty are unwrapped and the previous
adapter stays active (or the base model, if there was none).  Base weights are never
written: ``init_lora_weights`` is forced to ``False`` (so PiSSA/OLoRA-style initialisers
cannot modify the base) and removal unwraps every LoRA layer back to its original module.
With ``merge`` (`EngineConfig.merge_lora`) the active adapter is merged into new weight tensors: the base tensors are
kept aside and handed back, untouched, before every change (`lora_merge.py`).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from peft import LoraConfig
from peft.functional import delete_adapter, inject_adapter_in_model, set_adapter, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists
from torch import nn

from .buckets import WeightSyncError
from .lora_format import (LORA_PARAM, LoRABindError, OmniTensorLoRARequest, load_lora_dir, lora_config_from_dict,
                          normalize_lora_keys, peft_config_to_dict)
from .lora_merge import MergedLoRA


def _unwrap_empty_lora_layers(module: nn.Module) -> int:
    """Replace every LoRA wrapper that holds no adapter any more by its base layer."""
    names = [n for n, m in module.named_modules() if isinstance(m, BaseTunerLayer) and not _has_adapters(m)]
    # deepest first, so parents are resolved after their children were swapped
    for name in sorted(names, key=lambda n: n.count("."), reverse=True):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        wrapper = getattr(parent, child)
        setattr(parent, child, wrapper.get_base_layer())
    return len(names)


def _has_adapters(layer: BaseTunerLayer) -> bool:
    return any(len(getattr(layer, attr, {})) for attr in layer.adapter_layer_names)


class LoRAManager:
    """Owns the (at most one) active LoRA adapter of ``module``."""

    _PREFIX = "lora_"

    def __init__(self, module: nn.Module, adapter_dtype: torch.dtype | None = None, merge: bool = False):
        """adapter_dtype: the dtype LoRA weights are kept and computed in; None (the default) takes the dtype of the
        tensors each update carries (the trainer's), so trainer and engine compute the adapter alike. merge: keep
        the active adapter merged into the base weights (`lora_merge.py`: the base model's forward cost; exact
        unmerge)."""
        if adapter_dtype is not None and not adapter_dtype.is_floating_point:
            raise ValueError(f"adapter_dtype must be a floating dtype, got {adapter_dtype}")
        self.module = module
        self.adapter_dtype = adapter_dtype
        self.merge = merge
        self._merged = MergedLoRA()
        self._adapter: str | None = None  # internal PEFT adapter name
        self._config: LoraConfig | None = None
        self._request: OmniTensorLoRARequest | None = None
        self._seq = itertools.count()
        self._base_requires_grad: list[tuple[torch.nn.Parameter, bool]] = []
        self._params: dict[str, torch.nn.Parameter] = {}  # normalised key -> live LoRA parameter
        self._config_dict: dict | None = None

    @property
    def active_lora(self) -> str | None:
        return self._request.lora_name if self._request else None

    @property
    def lora_int_id(self) -> int | None:
        return self._request.lora_int_id if self._request else None

    def _resolve(self, req: OmniTensorLoRARequest) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
        cfg, tensors = req.peft_config, req.lora_tensors
        if tensors is None:
            if not req.lora_path:
                raise WeightSyncError(f"LoRA request {req.lora_name!r} has neither lora_tensors nor lora_path")
            file_cfg, tensors = load_lora_dir(req.lora_path)
            cfg = cfg or file_cfg
        if not tensors:
            raise LoRABindError(f"LoRA request {req.lora_name!r} carries no tensors")
        return lora_config_from_dict(cfg), normalize_lora_keys(tensors, self.module)

    def _precheck(self, cfg: LoraConfig, tensors: dict[str, Any]) -> None:
        """Bind every key to a targeted module before touching anything (values may be shapes or tensors)."""
        modules = dict(self.module.named_modules())
        unmatched = []
        for key in tensors:
            m = LORA_PARAM.match(key)
            mod = m.group("mod") if m else None
            if mod is None or mod not in modules or not check_target_module_exists(cfg, mod):
                unmatched.append(key)
        if unmatched:
            what = "binds zero modules" if len(unmatched) == len(tensors) else "leaves tensors unmatched"
            raise LoRABindError(f"LoRA adapter {what}: {len(unmatched)} unmatched key(s): "
                                f"{', '.join(sorted(unmatched)[:20])}", sorted(unmatched))

    def check_update(self, peft_config: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
        """Check an adapter from its config and its tensors' names and shapes alone (nothing is touched): the config
        parses, every key binds to a targeted module, and a Linear's lora_A / lora_B fit its in / out features
        and agree on the rank. Returns {sent name: normalised key}."""
        cfg = lora_config_from_dict(peft_config)
        keys = normalize_lora_keys({n: n for n in shapes}, self.module)  # normalised key -> sent name
        self._precheck(cfg, keys)
        bad, ranks = [], {}
        for key, sent in keys.items():
            m = LORA_PARAM.match(key)
            layer = self.module.get_submodule(m.group("mod"))
            base = layer.get_base_layer() if isinstance(layer, BaseTunerLayer) else layer
            shape = tuple(shapes[sent])
            if not isinstance(base, nn.Linear) or m.group("p") not in ("lora_A", "lora_B") or len(shape) != 2:
                continue
            want = (None, base.in_features) if m.group("p") == "lora_A" else (base.out_features, None)
            if any(w is not None and w != s for w, s in zip(want, shape)):
                bad.append(f"{sent}: {shape} does not fit {m.group('mod')} ({base.in_features} -> {base.out_features})")
            ranks.setdefault(m.group("mod"), set()).add(shape[0] if m.group("p") == "lora_A" else shape[1])
        bad += [f"{mod}: lora_A and lora_B disagree on the rank ({sorted(r)})"
                for mod, r in ranks.items() if len(r) > 1]
        if bad:
            raise LoRABindError(f"LoRA adapter does not fit the module: {', '.join(sorted(bad)[:20])}",
                                [b.split(':')[0] for b in bad])
        return {sent: key for key, sent in keys.items()}

    def add_lora(self, request: OmniTensorLoRARequest) -> None:
        """Build ``request``'s adapter next to the active one, verify it, then swap (merged afterwards when
        ``merge``; the previous adapter, merged again, stays active on any error)."""
        self.unmerge_weights()
        try:
            self._add_lora(request)
        finally:
            self.merge_weights()

    def _add_lora(self, request: OmniTensorLoRARequest) -> None:
        cfg, tensors = self._resolve(request)
        cfg_dict = peft_config_to_dict(cfg)  # before PEFT gets to normalise cfg in place
        dtype = self._compute_dtype(request, tensors)
        if request.load_inplace and self._same_structure(cfg_dict, tensors, dtype):
            self._copy_inplace(tensors)
            self._request = request
            return
        self._precheck(cfg, tensors)
        new = f"omni_{int(request.lora_int_id)}_{next(self._seq)}"
        prev, prev_cfg = self._adapter, self._config
        if prev is None:  # PEFT freezes base params; requires_grad even changes CPU kernels
            self._base_requires_grad = [(p, p.requires_grad) for p in self.module.parameters()]
        try:
            with warnings.catch_warnings():
                # two adapters coexist on purpose for the duration of the swap
                warnings.filterwarnings("ignore", message=".*peft_config.*multiple adapters.*")
                inject_adapter_in_model(cfg, self.module, adapter_name=new)
            self._prepare_layers(new, dtype)
            try:
                result = set_peft_model_state_dict(self.module, tensors, adapter_name=new)
            except RuntimeError as e:  # size mismatches from load_state_dict
                raise LoRABindError(f"LoRA adapter {request.lora_name!r} does not fit the module: {e}") from e
            unexpected = [k for k in result.unexpected_keys if self._PREFIX in k]
            missing = [k for k in result.missing_keys if f".{new}." in k or k.endswith(f".{new}")]
            if unexpected or missing:
                raise LoRABindError(
                    f"LoRA adapter {request.lora_name!r} does not bind cleanly: unexpected={sorted(unexpected)[:20]} "
                    f"missing={sorted(missing)[:20]}", sorted(unexpected) + sorted(missing))
            set_adapter(self.module, new, inference_mode=True)
        except Exception:
            self._drop(new)
            if prev is not None:
                set_adapter(self.module, prev, inference_mode=True)
            else:
                self._restore_requires_grad()
            self._set_module_config(prev, prev_cfg)
            raise
        if prev is not None:
            self._drop(prev)
        self._adapter, self._config, self._request = new, cfg, request
        self._params = {k: self._lora_param(k, new) for k in tensors}
        self._config_dict = cfg_dict
        self._set_module_config(new, cfg)

    def remove_lora(self) -> bool:
        """Remove the active adapter; the module is back to its exact original structure."""
        if self._adapter is None:
            return False
        self.unmerge_weights()
        self._drop(self._adapter)
        self._restore_requires_grad()
        self._adapter = self._config = self._request = None
        self._params = {}
        self._set_module_config(None, None)
        return True

    def merge_weights(self) -> None:
        """With ``merge``: the active adapter merged into the base weights (a no-op when merged already, or with no
        adapter). A merge that fails leaves the adapter running unmerged, and raises."""
        if self.merge and self._adapter is not None and not self._merged:
            self._merged.merge(self.module, self._adapter)

    def unmerge_weights(self) -> None:
        """The base weights back in their layers, exactly (the adapter, if any, then runs unmerged): before anything
        writes or moves the base weights (a full update, sleep), and before every adapter change."""
        self._merged.unmerge()

    def _lora_param(self, key: str, adapter: str) -> torch.nn.Parameter:
        m = LORA_PARAM.match(key)  # normalised keys: the optional "adapter" group holds the suffix
        suffix = m.group("suffix") or m.group("adapter")
        name = f"{m.group('mod')}.{m.group('p')}.{adapter}" + (f".{suffix}" if suffix else "")
        return self.module.get_parameter(name)

    def _compute_dtype(self, request: OmniTensorLoRARequest, tensors: dict[str, torch.Tensor]) -> torch.dtype:
        if self.adapter_dtype is not None:
            return self.adapter_dtype
        dtypes = sorted({str(t.dtype) for t in tensors.values() if t.is_floating_point()})
        if len(dtypes) != 1:
            raise LoRABindError(f"LoRA adapter {request.lora_name!r} mixes tensor dtypes {dtypes}: send one dtype "
                                f"(the one the trainer computes the adapter in) or set LoRAManager(adapter_dtype=...)")
        return next(t.dtype for t in tensors.values() if t.is_floating_point())

    def _prepare_layers(self, adapter: str, dtype: torch.dtype) -> None:
        """The new adapter's weights in `dtype`; every LoRA layer in eval mode (no dropout during rollout)."""
        for layer in self.module.modules():
            if not isinstance(layer, LoraLayer):
                continue
            for attr in layer.adapter_layer_names:
                holder = getattr(layer, attr, None)
                if holder is None or adapter not in holder:
                    continue
                item = holder[adapter]
                if isinstance(item, nn.Parameter):
                    item.data = item.data.to(dtype)
                else:
                    item.to(dtype)
            layer.train(False)

    def _same_structure(self, cfg_dict: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
        """Same config, same keys, shapes and compute dtype as the active adapter: update it in place."""
        if self._adapter is None or cfg_dict != self._config_dict:
            return False
        if any(p.dtype != dtype for p in self._params.values()):
            return False
        if tensors.keys() != self._params.keys():
            return False
        return all(tuple(t.shape) == tuple(self._params[k].shape) for k, t in tensors.items())

    def _copy_inplace(self, tensors: dict[str, torch.Tensor]) -> None:
        # names, shapes and config were all checked by _same_structure: the copies cannot fail
        with torch.no_grad():
            for k, t in tensors.items():
                self._params[k].copy_(t)

    def _restore_requires_grad(self) -> None:
        for p, flag in self._base_requires_grad:
            p.requires_grad_(flag)
        self._base_requires_grad = []

    def _drop(self, name: str) -> None:
        if any(isinstance(m, BaseTunerLayer) for m in self.module.modules()):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                delete_adapter(self.module, name, prefix=self._PREFIX, layer_cls=LoraLayer)
        _unwrap_empty_lora_layers(self.module)

    def _set_module_config(self, name: str | None, cfg: LoraConfig | None) -> None:
        # PEFT records the configs of injected adapters on the module; keep it truthful
        if name is None:
            if hasattr(self.module, "peft_config"):
                del self.module.peft_config
        else:
            self.module.peft_config = {name: cfg}
