"""The shapes-video model's training data: captioned clips of the moving-shapes world's training split, each batch a
pure function of (seed, index), so that any step's batch is drawn again exactly after a restart (no stateful
iterator to save).

A caption is a category drawn by `weights` (default: each category alike, whatever its number of prompts), then one
of its training prompts uniformly; its clip is `render_prompt(caption, clip_seed, layout=two_motions_layout)` with a
clip seed drawn from the same generator (the layout: where a two-motion clip puts its objects; the world's "any" by
default). Held-out prompts are never captions.
"""

from __future__ import annotations

import numpy as np
import torch

from omniroll.tasks.moving_shapes.grammar import TAGS, parse_prompt
from omniroll.tasks.moving_shapes.render import render_prompt
from omniroll.tasks.moving_shapes.scene import TWO_MOTIONS_LAYOUTS
from omniroll.tasks.moving_shapes.splits import split_prompts
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld


class TrainingClips:
    """The training split's prompts by category; `batch(seed, index, n)` draws n captioned clips."""

    def __init__(self, weights: dict | None = None, world: MovingWorld = DEFAULT_MOVING_WORLD,
                 two_motions_layout: str = "any"):
        if two_motions_layout not in TWO_MOTIONS_LAYOUTS:
            raise ValueError(f"two_motions_layout must be one of {list(TWO_MOTIONS_LAYOUTS)}, got "
                             f"{two_motions_layout!r}")
        self.world, self.layout = world, two_motions_layout
        by_tag: dict[str, list[str]] = {t: [] for t in TAGS}
        for p in split_prompts("train", world):
            by_tag[parse_prompt(p, world).tag].append(p)
        weights = {t: 1.0 for t in TAGS} if weights is None else dict(weights)
        unknown = sorted(set(weights) - set(TAGS))
        if unknown:
            raise ValueError(f"category weights: unknown categories {unknown}; known: {list(TAGS)}")
        self.tags = [t for t in TAGS if by_tag[t] and weights.get(t, 0) > 0]
        if not self.tags:
            raise ValueError(f"category weights: every category has weight 0, got {weights}")
        self.prompts = {t: by_tag[t] for t in self.tags}
        w = np.asarray([weights[t] for t in self.tags], dtype=np.float64)
        self.p = w / w.sum()

    def draws(self, seed: int, index: int, n: int) -> tuple[list[str], list[int]]:
        """(captions, render seeds) of `batch(seed, index, n)`'s clips, without rendering them."""
        rng = np.random.default_rng([seed, index])
        caps = []
        for t in rng.choice(len(self.tags), size=n, p=self.p):
            pool = self.prompts[self.tags[int(t)]]
            caps.append(pool[int(rng.integers(len(pool)))])
        return caps, [int(s) for s in rng.integers(0, 2 ** 62, size=n)]

    def batch(self, seed: int, index: int, n: int) -> tuple[list[str], np.ndarray]:
        """(captions, uint8 clips [n, T, 3, H, W]): the same for the same (seed, index, n)."""
        caps, seeds = self.draws(seed, index, n)
        return caps, np.stack([render_prompt(c, s, self.world, self.layout) for c, s in zip(caps, seeds)])


def to_video_range(clips: np.ndarray) -> torch.Tensor:
    """uint8 [n, T, 3, H, W] -> float32 [n, 3, T, H, W] in [-1, 1] (the Wan VAE's input layout and range)."""
    return torch.from_numpy(np.ascontiguousarray(clips)).permute(0, 2, 1, 3, 4).float().div(127.5).sub(1.0)


def to_clips(video: torch.Tensor) -> np.ndarray:
    """float [n, 3, T, H, W] in [-1, 1] -> uint8 [n, T, 3, H, W] (clamped, rounded)."""
    return ((video.detach().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 1, 3, 4).numpy()
