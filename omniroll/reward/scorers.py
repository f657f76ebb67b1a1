"""Scoring a sample: what a scorer sees and returns (`RewardSample`, `RewardResult`), the builtin rewards (JPEG,
prompt colour), user functions (`"module:function"`), the HTTP scorer, a VLM judge over an OpenAI-compatible API
(`openai_judge`), and the name registry.

A *scorer* is a sync or async callable `fn(samples: list[RewardSample]) -> list[float | dict]` returning one value per
sample, in order. A dict value must hold `"score"`; its other keys are copied into the row's `extra_info` as
`"{name}/{key}"`. The `RewardManager` checks the length and that every score is a finite number; anything else is a
failure of that function (retried, then reported), never a 0.

`prompt_colour`: how strongly an image shows the colour its prompt names (a reward that depends on the prompt). The
prompt's first colour word (red, green, blue, yellow, cyan, magenta, orange, purple) picks a target colour c in RGB
[0, 1]; with d = c - mean(c) (so grey pixels score 0), a pixel p scores d . p / sum(max(d, 0)), which is 1 for a pixel
of the pure colour (R - (G + B) / 2 for red). The reward is the mean over pixels, in [-1, 1]. A prompt that names no
colour is an error of the scorer (reported, never a reward of 0).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import io
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Literal, Optional, Sequence, Union

import numpy as np
from PIL import Image

from omniroll.reward.clip import AestheticScorer, ClipScoreScorer, PickScoreScorer
from omniroll.reward.http import HttpScorer, decode_png_batch, decode_safetensors_batch
from omniroll.reward.moving_shapes import MOVING_SHAPES_SCORERS
from omniroll.reward.ocr import OcrScorer
from omniroll.reward.openai_judge import OpenAIJudge
from omniroll.reward.shapes import SHAPES_SCORERS
from omniroll.reward.shapes_proxy import SHAPES_PROXY_SCORERS

# ------------------------------------------------------------------------------------------------ the contract
RewardStatus = Literal["ok", "flagged", "failed"]
STATUSES = ("ok", "flagged", "failed")


@dataclass
class RewardSample:
    """One generated image (or video) to score.

    `image` is uint8 CHW with 3 channels (`[3, H, W]`), the layout the engine emits; scorers that need HWC call
    `sample.hwc()`. A video sample carries all its frames, `[T, 3, H, W]` (`is_video`; `frames()` gives `[T, 3, H, W]`
    for both kinds): the builtin JPEG scorers score a video as the mean over its frames, the HTTP scorer sends it
    whole with `encoding="safetensors"` and refuses it with `"png"`, and user functions receive it as is.
    `ground_truth` and `extra_info` are passed through to scorers untouched (dataset-specific).
    """

    sample_id: str
    image: np.ndarray
    prompt: str
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.sample_id, str) or not self.sample_id:
            raise ValueError(f"RewardSample.sample_id must be a non-empty str, got {self.sample_id!r}")
        if not isinstance(self.image, np.ndarray):
            raise TypeError(f"RewardSample.image must be a numpy.ndarray, got {type(self.image).__name__}")
        if self.image.dtype != np.uint8:
            raise ValueError(f"RewardSample.image must have dtype uint8 (values 0..255), got {self.image.dtype}")
        shape = self.image.shape
        if self.image.ndim not in (3, 4) or shape[-3] != 3 or min(shape) < 1:
            raise ValueError(f"RewardSample.image must be CHW with shape [3, H, W] (or a video [T, 3, H, W]; "
                             f"T, H, W >= 1), got shape {tuple(shape)}")
        if not isinstance(self.prompt, str):
            raise TypeError(f"RewardSample.prompt must be a str, got {type(self.prompt).__name__}")
        if not isinstance(self.data_source, str):
            raise TypeError(f"RewardSample.data_source must be a str, got {type(self.data_source).__name__}")
        if not isinstance(self.extra_info, dict):
            raise TypeError(f"RewardSample.extra_info must be a dict, got {type(self.extra_info).__name__}")

    @property
    def is_video(self) -> bool:
        return self.image.ndim == 4

    def frames(self) -> np.ndarray:
        """`[T, 3, H, W]`: a video's frames, or an image as one frame."""
        return self.image if self.is_video else self.image[None]

    def hwc(self) -> np.ndarray:
        """The image as a contiguous uint8 `[H, W, 3]` array (PIL / OpenCV layout). A video has no single image:
        ValueError (score `frames()` instead)."""
        if self.is_video:
            raise ValueError(f"sample {self.sample_id!r} is a video {tuple(self.image.shape)}; hwc() is for images, "
                             f"use frames()")
        return np.ascontiguousarray(self.image.transpose(1, 2, 0))


@dataclass
class RewardResult:
    """The reward of one sample.

    - `status="ok"`: every function succeeded; `score` is the weighted sum of all components.
    - `status="flagged"`: at least one *non-required* function failed; its component is `None` (never 0), its error
      is in `extra_info["{name}/error"]`, `extra_info["reward/missing"]` lists the failed names, and `score` is the
      weighted sum over the functions that succeeded (weights are *not* renormalized).
    - `status="failed"`: a required function failed (or nothing succeeded); `score is None` and `error` says why.

    `started_at` / `finished_at` are `time.time()` stamps of the scoring call that produced this row.
    """

    sample_id: str
    score: Optional[float]
    components: dict[str, Optional[float]] = field(default_factory=dict)
    extra_info: dict = field(default_factory=dict)
    status: RewardStatus = "ok"
    error: Optional[str] = None
    started_at: float = 0.0
    finished_at: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"RewardResult.status must be one of {STATUSES}, got {self.status!r}")
        if self.status == "failed" and self.score is not None:
            raise ValueError("RewardResult.score must be None when status is 'failed'")
        if self.status != "failed":
            if self.score is None or not math.isfinite(self.score):
                raise ValueError(f"RewardResult.score must be a finite float when status is {self.status!r}, "
                                 f"got {self.score!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.started_at

    def to_dict(self) -> dict:
        return asdict(self)


ScoreValue = Union[float, dict]
Scorer = Callable[[list[RewardSample]], Union[Sequence[ScoreValue], Awaitable[Sequence[ScoreValue]]]]

__all__ = [
    "HttpScorer",
    "RewardResult",
    "RewardSample",
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
    "prompt_colour",
    "prompt_problems",
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


# ----------------------------------------------------------------------------------------------- prompt colour
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0), "orange": (1.0, 0.5, 0.0), "purple": (0.5, 0.0, 1.0),
}
_WORD = re.compile(r"[a-z]+")


def prompt_colour_name(prompt: str) -> str:
    for w in _WORD.findall(prompt.lower()):
        if w in COLOURS:
            return w
    raise ValueError(f"prompt names no colour (one of {sorted(COLOURS)}): {prompt[:80]!r}")


def colour_score(image_chw: np.ndarray, colour: str) -> float:
    c = np.asarray(COLOURS[colour], dtype=np.float64)
    d = c - c.mean()
    d = d / d.clip(min=0).sum()
    pixels = image_chw.reshape(3, -1).astype(np.float64) / 255.0
    return float((d @ pixels).mean())


def prompt_colour(samples: list[RewardSample]) -> list[float]:
    """One score per sample: the mean over pixels of how much each shows the prompt's colour, in [-1, 1]."""
    return [colour_score(s.image, prompt_colour_name(s.prompt)) for s in samples]


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
    "openai_judge": OpenAIJudge,
    "prompt_colour": _no_kwargs("prompt_colour", prompt_colour),
    "ocr": OcrScorer,
    "pickscore": PickScoreScorer,
    "clip_score": ClipScoreScorer,
    "aesthetic": AestheticScorer,
    **SHAPES_SCORERS,
    **SHAPES_PROXY_SCORERS,
    **MOVING_SHAPES_SCORERS,
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


def prompt_problems(fn: Union[str, Callable], prompts: Sequence[str]) -> list[str]:
    """The prompts a registered scorer cannot score, one line each, found before anything runs: the factory's own
    `check_prompts(prompts)` (the shapes rewards: a prompt outside the grammar, with its nearest valid form); []
    for scorers that take any prompt."""
    factory = SCORER_REGISTRY.get(fn) if isinstance(fn, str) else None
    check = getattr(factory, "check_prompts", None)
    return list(check(list(prompts))) if callable(check) else []


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
