"""The cheats a video checker must refuse: a clip's frames reversed in time, shuffled, or frozen to the first frame.

Each is an order of frame indices (`cheat_order`), applied to a clip (`apply_order`: `clip[order]`) or to its
per-frame detections, so a cheat shows exactly the clip's own pictures, only not in their time order:

    reversed  T-1, ..., 1, 0
    frozen    0, 0, ..., 0 (the first frame repeated: a static clip)
    shuffled  a seeded random derangement (no frame keeps its place) that breaks monotonicity: it is drawn
              uniformly again until (a) at most `max_same_way` (default floor(5 (T - 1) / 8): 5 of 8 for 9 frames)
              of its T - 1 steps go forward in time and at most as many backward, and (b) a frame of the clip's
              last third (the last T // 3 frames) lands among its first third's places. A shuffle that happens to
              keep the clip mostly in order (or mostly reversed), or only swaps frames within the beginning and
              within the end (which keeps an appearance or a colour change where it was: a clip still showing what
              its prompt asks), is not called a shuffle. Uniform derangements without (a) and (b) are measured too
              (`benchmarks/moving_shapes_checker.py`): the checker passes 0.0-0.2 % of them (clips that
              still show what their prompt asks: a colour change kept in place, a nearly monotone motion).

The frozen and shuffled clips are also the baselines a video model must beat on the motion categories.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

CHEATS = ("reversed", "shuffled", "frozen")


def shuffled_order(frames: int, rng: np.random.Generator, max_same_way: Optional[int] = None,
                   max_tries: int = 10_000) -> np.ndarray:
    """A derangement of range(frames) breaking monotonicity (module doc)."""
    if frames < 3:
        raise ValueError(f"frames must be >= 3 to shuffle, got {frames}")
    limit = (5 * (frames - 1)) // 8 if max_same_way is None else int(max_same_way)
    if not (frames - 1) / 2 <= limit <= frames - 1:
        raise ValueError(f"max_same_way must be in [{(frames - 1) / 2:g}, {frames - 1}], got {limit}")
    for _ in range(max_tries):
        order = rng.permutation(frames)
        forward = int((np.diff(order) > 0).sum())
        third = frames // 3
        end_first = bool((order[:third] >= frames - third).any())
        if (order != np.arange(frames)).all() and forward <= limit and frames - 1 - forward <= limit and end_first:
            return order
    raise RuntimeError(f"no shuffle of {frames} frames found in {max_tries} draws")


def cheat_order(name: str, frames: int, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """The frame order of a cheat (module doc); `rng` is needed for "shuffled"."""
    if name == "reversed":
        return np.arange(frames)[::-1].copy()
    if name == "frozen":
        return np.zeros(frames, dtype=np.int64)
    if name == "shuffled":
        if rng is None:
            raise ValueError("cheat 'shuffled' needs an rng (a seeded numpy Generator)")
        return shuffled_order(frames, rng)
    raise ValueError(f"cheat must be one of {list(CHEATS)}, got {name!r}")


def apply_order(clip, order) -> np.ndarray:
    """The clip ([T, ...] array) with its frames in `order`."""
    clip = np.asarray(clip)
    order = np.asarray(order)
    if order.ndim != 1 or len(order) != len(clip) or order.min() < 0 or order.max() >= len(clip):
        raise ValueError(f"order must be {len(clip)} frame indices in [0, {len(clip) - 1}], got {order.tolist()}")
    return np.ascontiguousarray(clip[order])
