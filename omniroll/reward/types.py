"""Reward data contract: `RewardSample` (what a scorer sees) and `RewardResult` (what comes back per row)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

import numpy as np

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
