"""Shape outlines: which points of the plane lie inside a circle, a square or an upright triangle of a given box.

One function per shape kind, shared by the renderer (which fills it with antialiasing) and the checker (which
compares a detected blob with each outline fitted to the blob's box), so the two can never disagree about what a
shape looks like. A new shape kind is one function here plus its name in `World.shapes`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

#: inside(dx, dy, w, h) -> bool array: (dx, dy) offsets from the box centre (image axes: y grows downwards)
Outline = Callable[[np.ndarray, np.ndarray, float, float], np.ndarray]


def circle(dx: np.ndarray, dy: np.ndarray, w: float, h: float) -> np.ndarray:
    """The ellipse inscribed in the w x h box (a circle when w == h)."""
    return (dx / (w / 2)) ** 2 + (dy / (h / 2)) ** 2 <= 1.0


def square(dx: np.ndarray, dy: np.ndarray, w: float, h: float) -> np.ndarray:
    """The whole w x h box."""
    return (np.abs(dx) <= w / 2) & (np.abs(dy) <= h / 2)


def triangle(dx: np.ndarray, dy: np.ndarray, w: float, h: float) -> np.ndarray:
    """Apex at the top centre, base along the bottom edge (upright, isosceles)."""
    depth = (dy + h / 2) / h  # 0 at the apex, 1 at the base
    return (depth >= 0) & (depth <= 1) & (np.abs(dx) <= depth * w / 2)


OUTLINES: dict[str, Outline] = {"circle": circle, "square": square, "triangle": triangle}


def coverage(kind: str, cx: float, cy: float, w: float, h: float, height: int, width: int,
             supersample: int = 4) -> np.ndarray:
    """[height, width] float32 in [0, 1]: the share of each pixel inside the outline centred at (cx, cy), measured
    on a supersample x supersample grid of points per pixel (pixel (i, j) spans [j, j + 1) x [i, i + 1))."""
    s = int(supersample)
    offsets = (np.arange(s, dtype=np.float64) + 0.5) / s
    ys = (np.arange(height)[:, None] + offsets[None, :]).reshape(-1)
    xs = (np.arange(width)[:, None] + offsets[None, :]).reshape(-1)
    inside = OUTLINES[kind](xs[None, :] - cx, ys[:, None] - cy, w, h)
    return inside.reshape(height, s, width, s).mean(axis=(1, 3)).astype(np.float32)
