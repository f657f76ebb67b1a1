"""verl's config -> omniroll's.

Read from verl's `actor_rollout_ref`: `model.path` (a local diffusers checkpoint), `rollout.dtype`, `rollout.n`,
`rollout.seed`, `rollout.calculate_log_probs`, `rollout.prompt_length`, `rollout.agent.num_workers`,
`rollout.val_kwargs.{n, seed}`; VeRL-Omni's `rollout.pipeline.*` / `rollout.algo.*` (and `val_kwargs.pipeline/algo`)
through the sampling map of `sampling.py`; then `rollout.custom.omniroll`, any part of omniroll's own config
(`engine.max_batch_size`, `engine.device`, `pipeline.*`, `algo.*`, `agent.on_failure`, ...), which wins.
"""

from __future__ import annotations

from typing import Any

from omniroll.config import (AlgoSection, OmniRollConfig, PipelineSection, PartialAlgo, PartialPipeline,
                             load_config)
from omniroll.integrations.verl.sampling import flatten, map_sampling_params

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32"}
PIPELINE_KEYS = tuple(PipelineSection.model_fields)
ALGO_KEYS = tuple(AlgoSection.model_fields)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    try:
        value = cfg.get(key, default)  # DictConfig and verl's BaseConfig dataclasses
    except (AttributeError, TypeError):
        value = getattr(cfg, key, default)
    return default if value is None else value


def _plain(obj: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        pass
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return dict(obj) if isinstance(obj, dict) else obj


def _custom(rollout: Any) -> dict:
    custom = _plain(_get(rollout, "custom", None)) or {}
    return dict(_plain(custom.get("omniroll")) or {}) if isinstance(custom, dict) else {}


def dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"rollout.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def engine_kwargs_from_verl(rollout: Any, on_gpu: bool) -> dict:
    """`DiffusionEngine.from_pretrained` kwargs for a replica: rollout.dtype, the device it was given, and
    `rollout.custom.omniroll.engine` (which wins)."""
    engine = dict(_custom(rollout).get("engine") or {})
    engine.pop("model", None)
    kw = {"dtype": dtype_name(_get(rollout, "dtype", "bfloat16")), "device": "cuda" if on_gpu else "cpu"}
    kw.update({k: v for k, v in engine.items() if k != "kwargs"})
    kw.update(engine.get("kwargs") or {})
    return kw


def _split(sampling: dict) -> dict:
    fields, _, _ = map_sampling_params(sampling)
    return {"pipeline": {k: v for k, v in fields.items() if k in PIPELINE_KEYS},
            "algo": {k: v for k, v in fields.items() if k in ALGO_KEYS}}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def omniroll_config_from_verl(config: Any) -> OmniRollConfig:
    """The OmniRollConfig for verl's whole trainer config (see the module doc)."""
    ref = _get(config, "actor_rollout_ref")
    rollout, model = _get(ref, "rollout"), _get(ref, "model")
    if rollout is None or model is None:
        raise ValueError("a verl config needs actor_rollout_ref.rollout and actor_rollout_ref.model")
    val = _get(rollout, "val_kwargs")
    base: dict[str, Any] = {
        "engine": {"model": str(_get(model, "local_path") or _get(model, "path")),
                   "dtype": dtype_name(_get(rollout, "dtype", "bfloat16"))},
        "n": int(_get(rollout, "n", 1)),
        "seed": _get(rollout, "seed"),
        "calculate_log_probs": bool(_get(rollout, "calculate_log_probs", True)),
        "prompt_length": int(_get(rollout, "prompt_length", 512)),
        "agent": {"num_workers": int(_get(_get(rollout, "agent"), "num_workers", 1))},
        "val_kwargs": {"n": int(_get(val, "n", 1)), "seed": int(_get(val, "seed", 42))},
    }
    pipeline, algo = _plain(_get(rollout, "pipeline")), _plain(_get(rollout, "algo"))
    if pipeline or algo:  # VeRL-Omni's DiffusionRolloutConfig
        base = _merge(base, _split(flatten(pipeline, algo)))
        if _get(rollout, "max_prompt_embed_length") is not None:
            base["max_prompt_embed_length"] = int(_get(rollout, "max_prompt_embed_length"))
        vp, va = _plain(_get(val, "pipeline")), _plain(_get(val, "algo"))
        if vp or va:
            v = flatten(vp, va)
            base["val_kwargs"].update(
                pipeline={k: v[k] for k in PartialPipeline.model_fields if k in v and v[k] is not None},
                algo={k: v[k] for k in PartialAlgo.model_fields if k in v and v[k] is not None})
    return load_config(_merge(base, _custom(rollout)))
