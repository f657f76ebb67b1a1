"""Scenes of the shapes world: the objects a picture holds, and a seeded sampler of scenes that satisfy a prompt.

A scene holds exactly the objects its prompt asks for: "three squares" is three squares (each of a random colour, as
colours the prompt does not name always are), "a circle left of a square" a circle and a square whose boxes stand in
that relation and in no other. Objects never overlap or touch (`World.gap`), so each is one blob for the checker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniroll.tasks.shapes.grammar import PromptSpec
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World


@dataclass(frozen=True)
class SceneObject:
    """One filled shape: its kind, colour name, centre (pixels, y downwards) and box side (pixels)."""

    shape: str
    colour: str
    cx: float
    cy: float
    size: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1)."""
        h = self.size / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]


class SceneError(RuntimeError):
    """No placement satisfying the prompt was found (the world's canvas is too small for its objects)."""


def _direction(box_a, box_b, threshold: float):
    """GenEval's shrunk centre offset of box A from box B over the offset's length: (dx, dy) in [-1, 1] each, or None
    when the shrunk offset is too small to say (see `relations`)."""
    ax0, ay0, ax1, ay1 = box_a
    bx0, by0, bx1, by1 = box_b
    off = np.array([(ax0 + ax1 - bx0 - bx1) / 2, (ay0 + ay1 - by0 - by1) / 2], dtype=np.float64)
    dims = np.array([(ax1 - ax0) + (bx1 - bx0), (ay1 - ay0) + (by1 - by0)], dtype=np.float64)
    revised = np.maximum(np.abs(off) - threshold * dims, 0) * np.sign(off)
    if np.all(np.abs(revised) < 1e-3):
        return None
    dx, dy = revised / np.linalg.norm(off)
    return float(dx), float(dy)


#: each relation's axis component of `_direction` and its sign: the relation holds when sign x component (its
#: margin) exceeds NAMED_MARGIN
RELATION_AXES = {"left of": (0, -1.0), "right of": (0, 1.0), "above": (1, -1.0), "below": (1, 1.0)}
NAMED_MARGIN = 0.5


def relations(box_a, box_b, threshold: float = 0.1) -> set[str]:
    """GenEval's position of box A relative to box B ((x0, y0, x1, y1) each): the centre offset, shrunk on each axis
    by `threshold` x (A's + B's extent on that axis), then named by its direction ("left of" when the shrunk x offset
    is below -0.5 of the offset's length; likewise right of, above, below). An empty set: too close to say."""
    d = _direction(box_a, box_b, threshold)
    if d is None:
        return set()
    return {rel for rel, (axis, sign) in RELATION_AXES.items() if sign * d[axis] > NAMED_MARGIN}


def relation_margin(box_a, box_b, relation: str, threshold: float = 0.1) -> float:
    """How far box A stands in `relation` to box B, in [-1, 1]: the component of `relations`' direction along the
    relation (GenEval names the relation above NAMED_MARGIN, 0.5; -1 is the opposite side; 0 when too close to
    say)."""
    if relation not in RELATION_AXES:
        raise ValueError(f"relation must be one of {sorted(RELATION_AXES)}, got {relation!r}")
    d = _direction(box_a, box_b, threshold)
    if d is None:
        return 0.0
    axis, sign = RELATION_AXES[relation]
    return sign * d[axis]


def _apart(a: SceneObject, b: SceneObject, gap: float) -> bool:
    ax0, ay0, ax1, ay1 = a.box
    bx0, by0, bx1, by1 = b.box
    return ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0


def sample_scene(spec: PromptSpec, rng: np.random.Generator, world: World = DEFAULT_WORLD,
                 max_tries: int = 2000, place_tries: int = 30) -> Scene:
    """A random scene holding exactly `spec`'s objects (unnamed colours drawn uniformly), placed without overlap;
    a position prompt's pair stands in its relation alone, and still does with GenEval's threshold doubled (so a
    checker that sees a box a pixel off still agrees). Each object gets `place_tries` positions to find room among
    those already placed before the scene starts over (at most `max_tries` times)."""
    colours = list(world.colours)
    wanted = [(r.shape, r.colour) for r in spec.include for _ in range(r.count)]
    relation = next(((i, r.position) for i, r in enumerate(spec.include) if r.position is not None), None)
    for _ in range(max_tries):
        objects: list[SceneObject] = []
        for shape, colour in wanted:
            size = float(rng.uniform(world.min_size, world.max_size))
            colour = colour or colours[int(rng.integers(len(colours)))]
            lo, hi = world.margin + size / 2, world.size - world.margin - size / 2
            for _ in range(place_tries):
                obj = SceneObject(shape, colour, float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi)), size)
                if all(_apart(obj, o, world.gap) for o in objects):
                    objects.append(obj)
                    break
            else:
                break
        else:
            if relation is not None:
                mover, (rel, target) = objects[relation[0]], relation[1]
                if any(relations(mover.box, objects[target].box, t) != {rel} for t in (0.1, 0.2)):
                    continue
            return Scene(tuple(objects))
    raise SceneError(f"no placement of {spec.prompt!r} found in {max_tries} tries on a {world.size}px canvas")
