"""The pretraining data of the shapes model: captioned scenes of the world's training split, drawn from a seed.

A caption is a training-split prompt picked by category (`CATEGORY_WEIGHTS`: the hard categories, position and colour
attribution, come up more often than their share of prompts would give them), then a prompt of that category
uniformly; the picture is a random scene of that prompt (`omniroll.tasks.shapes.sample_scene`). Held-out prompts are
never captions: the base model never reads them.
"""

from __future__ import annotations

import numpy as np

from omniroll.tasks.shapes.grammar import TAGS, parse_prompt
from omniroll.tasks.shapes.render import render
from omniroll.tasks.shapes.scene import sample_scene
from omniroll.tasks.shapes.splits import split_prompts
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World

#: how often each category's prompts caption a pretraining picture (relative)
CATEGORY_WEIGHTS = {"single_object": 1.0, "two_object": 1.0, "counting": 1.5, "colors": 1.0, "position": 2.0,
                    "color_attr": 2.0}


class CaptionedScenes:
    """Draws (captions, pictures) batches from the training split. Deterministic in `seed`."""

    def __init__(self, seed: int, world: World = DEFAULT_WORLD, weights: dict | None = None):
        self.world = world
        self.rng = np.random.default_rng(seed)
        weights = dict(CATEGORY_WEIGHTS if weights is None else weights)
        by_tag: dict[str, list[str]] = {t: [] for t in TAGS}
        for p in split_prompts("train", world):
            by_tag[parse_prompt(p, world).tag].append(p)
        self.tags = [t for t in TAGS if by_tag[t] and weights.get(t, 0) > 0]
        self.prompts = {t: by_tag[t] for t in self.tags}
        w = np.asarray([weights[t] for t in self.tags], dtype=np.float64)
        self.p = w / w.sum()
        self.specs = {p: parse_prompt(p, world) for t in self.tags for p in by_tag[t]}

    def captions(self, n: int) -> list[str]:
        tags = self.rng.choice(len(self.tags), size=n, p=self.p)
        out = []
        for t in tags:
            pool = self.prompts[self.tags[int(t)]]
            out.append(pool[int(self.rng.integers(len(pool)))])
        return out

    def pictures(self, captions: list[str]) -> np.ndarray:
        """uint8 [n, H, W, 3]: one random scene per caption."""
        return np.stack([render(sample_scene(self.specs[c], self.rng, self.world), self.world) for c in captions])

    def batch(self, n: int) -> tuple[list[str], np.ndarray]:
        caps = self.captions(n)
        return caps, self.pictures(caps)


def to_unit_range(pictures: np.ndarray):
    """uint8 [n, H, W, 3] -> float32 torch [n, 3, H, W] in [-1, 1] (the VAE's input range)."""
    import torch

    return torch.from_numpy(pictures).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
