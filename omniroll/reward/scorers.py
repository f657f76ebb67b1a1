"""Scorers: builtin JPEG rewards, user functions (`"module:function"`), the HTTP scorer, and the name registry.

A *scorer* is a sync or async callable `fn(samples: list[RewardSample]) -> list[float | dict]` returning one value per
sample, in order. A dict value must hold `"score"`; its other keys are copied into the row's `extra_info` as
`"{name}/{key}"`. The `RewardManager` checks the length and that every score is a finite number; anything else is a
failure of that function (retried, then reported), never a 0.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import io
from typing import Any, Awaitable, Callable, Sequence, Union

import numpy as np
from PIL import Image

from omniroll.reward.clip import AestheticScorer, ClipScoreScorer, PickScoreScorer
from omniroll.reward.colour import prompt_colour
from omniroll.reward.http import HttpScorer, decode_png_batch, decode_safetensors_batch
from omniroll.reward.ocr import OcrScorer
from omniroll.reward.types import RewardSample

ScoreValue = Union[float, dict]
Scorer = Callable[[list[RewardSample]], Union[Sequence[ScoreValue], Awaitable[Sequence[ScoreValue]]]]

__all__ = [
    "HttpScorer",
    "Scorer",
    "SCORER_REGISTRY",
    "build_scorer",
    "decode_png_batch",
    "decode_safetensors_batch",
    "is_async_callable",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "jpeg_size_kb",
    "load_function",
    "per_sample_to_batch",
    "register_scorer",
    "scorer_problems",
]


# ----------------------------------------------------------------------------------------------------------- JPEG
def jpeg_size_kb(image_chw: np.ndarray, quality: int = 95) -> float:
    """Size in kB (bytes / 1000) of the HWC image encoded by PIL as JPEG at `quality`."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0))).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def jpeg_incompressibility(samples: list[RewardSample]) -> list[float]:
    """flow_grpo's `jpeg_incompressibility`: the JPEG (PIL, quality 95) size of each image in kB (bytes / 1000).

    Larger (more detailed / noisier) images score higher. A video scores the mean over its frames.
    """
    return [float(np.mean([jpeg_size_kb(f, 95) for f in s.frames()])) for s in samples]


def jpeg_compressibility(samples: list[RewardSample]) -> list[float]:
    """flow_grpo's `jpeg_compressibility`: `-size_kB / 500`, with `size_kB` as in `jpeg_incompressibility`.

    Always <= 0; smaller JPEG files score higher (closer to 0).
    """
    return [-kb / 500.0 for kb in jpeg_incompressibility(samples)]


# ----------------------------------------------------------------------------------------------- user functions
def is_async_callable(fn: Any) -> bool:
    """True for `async def` functions, partials of them, and objects with an `async def __call__`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)
    return call is not None and not inspect.isfunction(fn) and inspect.iscoroutinefunction(call)


def per_sample_to_batch(fn: Callable[[RewardSample], Any]) -> Scorer:
    """Wrap a per-sample function `fn(sample) -> float | dict` (sync or async) into a batch scorer.

    Async functions run concurrently over the batch; sync ones run one after another (the manager already runs a sync
    scorer in a worker thread, so the event loop is never blocked).
    """
    if is_async_callable(fn):

        async def _batch_async(samples: list[RewardSample]):
            return list(await asyncio.gather(*(fn(s) for s in samples)))

        _batch_async.__name__ = f"per_sample({getattr(fn, '__name__', type(fn).__name__)})"
        return _batch_async

    def _batch(samples: list[RewardSample]):
        return [fn(s) for s in samples]

    _batch.__name__ = f"per_sample({getattr(fn, '__name__', type(fn).__name__)})"
    return _batch


def load_function(spec: str, per_sample: bool = False) -> Callable:
    """Import `"package.module:attr"` (the attr may be dotted: `"mod:Class.method"`).

    Returns the object as is (a batch scorer), or wrapped by `per_sample_to_batch` when `per_sample=True`. Raises
    `ValueError` naming the spec when the module or the attribute is missing or the object is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"reward function spec must be 'module:function', got {spec!r}")
    module_name, attr_path = spec.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward function spec must be 'module:function' (both parts non-empty), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"reward function {spec!r}: module {module_name!r} not found (is it on sys.path?)") from e
        raise ValueError(f"reward function {spec!r}: importing {module_name!r} failed: {e}") from e
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable")
    return per_sample_to_batch(obj) if per_sample else obj


# ------------------------------------------------------------------------------------------------------ registry
def _no_kwargs(name: str, fn: Scorer) -> Callable[..., Scorer]:
    def check_kwargs(kwargs: dict) -> list[str]:
        return [f"kwargs: reward scorer {name!r} takes no kwargs, got {sorted(kwargs)}"] if kwargs else []

    def factory(**kwargs):
        if kwargs:
            raise ValueError(f"reward scorer {name!r} takes no kwargs, got {sorted(kwargs)}")
        return fn

    factory.check_kwargs = check_kwargs
    return factory


SCORER_REGISTRY: dict[str, Callable[..., Scorer]] = {
    "jpeg_compressibility": _no_kwargs("jpeg_compressibility", jpeg_compressibility),
    "jpeg_incompressibility": _no_kwargs("jpeg_incompressibility", jpeg_incompressibility),
    "http": HttpScorer,
    "prompt_colour": _no_kwargs("prompt_colour", prompt_colour),
    "ocr": OcrScorer,
    "pickscore": PickScoreScorer,
    "clip_score": ClipScoreScorer,
    "aesthetic": AestheticScorer,
}


def register_scorer(name: str, factory: Callable[..., Scorer], overwrite: bool = False) -> None:
    """Register `factory(**kwargs) -> scorer` under `name` (usable as `"fn": name` in a reward config)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"scorer name must be a non-empty str without ':', got {name!r}")
    if name in SCORER_REGISTRY and not overwrite:
        raise ValueError(f"scorer {name!r} is already registered (pass overwrite=True to replace it)")
    SCORER_REGISTRY[name] = factory


def scorer_problems(fn: Union[str, Callable], kwargs: dict | None = None) -> list[str]:
    """What is wrong with a reward function's `fn` and `kwargs`, found without building it (no model is loaded):
    an unknown registry name, a 'module:function' that does not import, kwargs the factory does not take or lacks
    (`http` without `url`), and the factory's own `check_kwargs(kwargs)` (paths of model directories). One line per
    problem, each starting with the key (`fn: ...`, `kwargs.model_dir: ...`)."""
    kwargs = dict(kwargs or {})
    if isinstance(fn, str) and ":" not in fn:
        if fn not in SCORER_REGISTRY:
            return [f"fn: unknown reward function {fn!r} (expected one of {sorted(SCORER_REGISTRY)} or "
                    f"'module:function')"]
        obj, factory = SCORER_REGISTRY[fn], True
    elif isinstance(fn, str):
        try:
            obj = load_function(fn)
        except ValueError as e:
            return [f"fn: {e}"]
        factory = inspect.isclass(obj)
    else:
        obj, factory = fn, inspect.isclass(fn)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        sig = None
    if sig is not None and (factory or kwargs):
        try:
            sig.bind(**kwargs) if factory else sig.bind_partial(**kwargs)
        except TypeError as e:
            return [f"kwargs: {e}"]
    check = getattr(obj, "check_kwargs", None)
    return list(check(kwargs)) if callable(check) else []


def build_scorer(fn: Union[str, Callable], kwargs: dict | None = None, per_sample: bool = False) -> Scorer:
    """Turn a config's `fn` into a batch scorer.

    - a registry name (`"jpeg_compressibility"`, `"jpeg_incompressibility"`, `"http"`, or one added with
      `register_scorer`): `factory(**kwargs)`;
    - `"module:function"` or a callable: if it is a class, it is instantiated with `kwargs` (a stateful scorer, e.g.
      one that loads a model once, with a sync or async `__call__`); otherwise `kwargs` are bound as keyword
      arguments (`functools.partial`). `per_sample=True` marks a per-sample `fn(sample)` function.
    """
    kwargs = dict(kwargs or {})
    if isinstance(fn, str):
        if ":" not in fn:
            if fn not in SCORER_REGISTRY:
                raise ValueError(
                    f"unknown reward fn {fn!r}: expected one of {sorted(SCORER_REGISTRY)} or 'module:function'"
                )
            if per_sample:
                raise ValueError(f"per_sample applies to user functions only, not to the builtin scorer {fn!r}")
            return SCORER_REGISTRY[fn](**kwargs)
        obj = load_function(fn)
    elif callable(fn):
        obj = fn
    else:
        raise TypeError(f"reward fn must be a str or a callable, got {type(fn).__name__}")
    if inspect.isclass(obj):
        obj = obj(**kwargs)
    elif kwargs:
        obj = functools.partial(obj, **kwargs)
    return per_sample_to_batch(obj) if per_sample else obj
