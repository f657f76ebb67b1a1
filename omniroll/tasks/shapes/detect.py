"""The checker's eyes: an exact CPU parser from a picture to the objects it shows.

1. Every pixel takes the nearest of the background and the world's colours (Euclidean RGB); the pixels nearest a
   colour are the foreground.
2. The foreground splits into 4-connected blobs (run-length union-find); blobs under `min_area` pixels are specks and
   are dropped.
3. A blob's colour is its most common colour when that colour holds at least `min_purity` of its pixels (else None:
   a blob of mixed colours has no colour).
4. Its shape is the outline (`outlines.OUTLINES`) that best matches it when stretched over the blob's box (the
   largest intersection over union, which must reach `min_iou`); a box with a side ratio outside
   [1 / max_aspect, max_aspect], or a blob that matches no outline, has no shape (None).

Detections come largest first: the checker's stand-in for a detector's confidence order, which GenEval's rules use
to pick "the" object when there are several of a class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from omniroll.tasks.shapes.outlines import OUTLINES, coverage
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World


@dataclass(frozen=True)
class Detection:
    """One blob: shape and colour (None when unrecognised), box (x0, y0, x1, y1) in pixels (x1, y1 exclusive),
    area in pixels, the best outline's intersection over union, the share of its pixels of its colour, and the share
    of its pixels nearest each of the world's colours ((name, share) pairs, in the world's order)."""

    shape: Optional[str]
    colour: Optional[str]
    box: tuple[int, int, int, int]
    area: int
    iou: float
    purity: float
    colour_shares: tuple[tuple[str, float], ...] = ()

    def share_of(self, colour: str) -> float:
        """The share of the blob's pixels nearest `colour` (0.0 for a colour it has none of)."""
        return dict(self.colour_shares).get(colour, 0.0)


@dataclass(frozen=True)
class DetectorSettings:
    min_area: int = 30
    min_purity: float = 0.6
    min_iou: float = 0.6
    max_aspect: float = 1.67


def colour_labels(image: np.ndarray, world: World = DEFAULT_WORLD) -> np.ndarray:
    """[H, W] int: 0 for background, i + 1 for the world's i-th colour (the nearest, in RGB)."""
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be an [H, W, 3] array, got {getattr(image, 'shape', type(image).__name__)}")
    palette = np.asarray([world.background, *world.colours.values()], dtype=np.float32)
    px = image.reshape(-1, 3).astype(np.float32)
    d = ((px[:, None, :] - palette[None, :, :]) ** 2).sum(-1)
    return d.argmin(1).reshape(image.shape[:2])


def connected_components(mask: np.ndarray) -> np.ndarray:
    """[H, W] int labels of the 4-connected components of a boolean mask (0: outside; 1..K in raster order of each
    component's first run)."""
    H, _ = mask.shape
    parent: list[int] = [0]

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    runs_by_row: list[list[tuple[int, int, int]]] = []
    prev: list[tuple[int, int, int]] = []
    for r in range(H):
        edges = np.diff(np.concatenate(([0], mask[r].astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        row = []
        for s, e in zip(starts.tolist(), ends.tolist()):
            label = len(parent)
            parent.append(label)
            for ps, pe, pl in prev:
                if ps < e and s < pe:  # the runs share a column: 4-connected
                    a, b = find(label), find(pl)
                    if a != b:
                        parent[max(a, b)] = min(a, b)
            row.append((s, e, label))
        runs_by_row.append(row)
        prev = row
    roots = {}
    out = np.zeros(mask.shape, dtype=np.int32)
    for r, row in enumerate(runs_by_row):
        for s, e, label in row:
            out[r, s:e] = roots.setdefault(find(label), len(roots) + 1)
    return out


def classify_shape(blob: np.ndarray, world: World = DEFAULT_WORLD,
                   settings: DetectorSettings = DetectorSettings()) -> tuple[Optional[str], float]:
    """(shape, IoU) of a blob cropped to its box ([h, w] bool): the best-matching outline stretched over the box."""
    h, w = blob.shape
    if max(h, w) > settings.max_aspect * min(h, w):
        return None, 0.0
    best, best_iou = None, 0.0
    for kind in world.shapes:
        if kind not in OUTLINES:
            continue
        template = coverage(kind, w / 2, h / 2, w, h, h, w) >= 0.5
        union = np.logical_or(blob, template).sum()
        iou = float(np.logical_and(blob, template).sum() / union) if union else 0.0
        if iou > best_iou:
            best, best_iou = kind, iou
    return (best, best_iou) if best_iou >= settings.min_iou else (None, best_iou)


def detect(image: np.ndarray, world: World = DEFAULT_WORLD,
           settings: DetectorSettings = DetectorSettings()) -> list[Detection]:
    """The objects in an [H, W, 3] uint8 picture, largest first (see the module doc)."""
    labels = colour_labels(image, world)
    blobs = connected_components(labels > 0)
    names = list(world.colours)
    found = []
    for k in range(1, int(blobs.max()) + 1):
        ys, xs = np.nonzero(blobs == k)
        area = len(ys)
        if area < settings.min_area:
            continue
        y0, y1, x0, x1 = int(ys.min()), int(ys.max()) + 1, int(xs.min()), int(xs.max()) + 1
        counts = np.bincount(labels[ys, xs], minlength=len(names) + 1)[1:]
        top = int(counts.argmax())
        purity = float(counts[top] / area)
        colour = names[top] if purity >= settings.min_purity else None
        shape, iou = classify_shape(blobs[y0:y1, x0:x1] == k, world, settings)
        shares = tuple((name, float(c / area)) for name, c in zip(names, counts.tolist()))
        found.append(Detection(shape, colour, (x0, y0, x1, y1), area, iou, purity, shares))
    found.sort(key=lambda d: (-d.area, d.box))
    return found
