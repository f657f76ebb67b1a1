"""`prompt_colour`: how strongly an image shows the colour its prompt names (a reward that depends on the prompt).

The prompt's first colour word (red, green, blue, yellow, cyan, magenta, orange, purple) picks a target colour c in
RGB [0, 1]; with d = c - mean(c) (so grey pixels score 0), a pixel p scores d . p / sum(max(d, 0)), which is 1 for a
pixel of the pure colour (R - (G + B) / 2 for red). The reward is the mean over pixels, in [-1, 1]. A prompt that
names no colour is an error of the scorer (reported, never a reward of 0).
"""

from __future__ import annotations

import re

import numpy as np

from omniroll.reward.types import RewardSample

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
