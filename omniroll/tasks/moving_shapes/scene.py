"""Scenes of the moving-shapes world: the objects a clip holds and how each moves, appears or changes colour, and a
seeded sampler of scenes that satisfy a prompt.

A scene holds exactly the objects its prompt asks for (colours the prompt does not name drawn uniformly):

    direction    one object travelling `min_move`-`max_move` px in a straight line at constant speed
    two_motions  two objects, each so, never touching in any frame
    order        two still objects; the clip opens empty, the first appears at one of `appear_frames`, the second
                 `appear_gap` frames later, and both stay to the end
    change       one still object in its first colour, then (from one of `change_frames` to the end) its second

Every object stays inside the canvas's margins in every frame, and two objects never overlap or touch
(`World.gap`), so each is one blob for the checker in every frame.

Where a two-motion scene puts its two objects is its `layout` (`TWO_MOTIONS_LAYOUTS`): "any" (the world's: wherever
their paths fit, either object on either side) or "first_left" (drawn again until the middle of the first-named
object's path lies at least `FIRST_LEFT_GAP` px left of the second's; a rule on the start would contradict the
directions, e.g. the first object moving left and the second right). The checker asks nothing of where objects are,
so both satisfy the prompt; "first_left" is a convention a model's training clips can follow so that each shape word
goes with a side of the clip (the shapes-video recipe's `two_motions_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from omniroll.tasks.moving_shapes.grammar import ClipSpec
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, DIRECTIONS, MovingWorld
from omniroll.tasks.shapes.scene import Scene, SceneError, SceneObject

#: where a two-motion scene puts its objects (module doc)
TWO_MOTIONS_LAYOUTS = ("any", "first_left")
#: px (of the 64 px canvas) the middle of the first-named object's path lies left of the other's under "first_left"
FIRST_LEFT_GAP = 8.0


@dataclass(frozen=True)
class MovingObject:
    """One filled shape through a clip: kind, box side (px), centre in the first and the last frame (it moves in a
    straight line at constant speed between them), colour, the frame it appears at (0: from the start) and, for a
    change, the colour it takes from frame `change_frame` on."""

    shape: str
    size: float
    start: tuple[float, float]
    end: tuple[float, float]
    colour: str
    appear: int = 0
    becomes: Optional[str] = None
    change_frame: Optional[int] = None

    def at(self, t: int, frames: int) -> Optional[SceneObject]:
        """The object in frame t of a clip of `frames` frames (None before it appears)."""
        if t < self.appear:
            return None
        f = t / (frames - 1)
        cx = self.start[0] + (self.end[0] - self.start[0]) * f
        cy = self.start[1] + (self.end[1] - self.start[1]) * f
        colour = self.becomes if self.becomes is not None and t >= self.change_frame else self.colour
        return SceneObject(self.shape, colour, cx, cy, self.size)


@dataclass(frozen=True)
class ClipScene:
    objects: tuple[MovingObject, ...]
    frames: int

    def frame(self, t: int) -> Scene:
        """The picture scene of frame t (the shapes world's `Scene`)."""
        if not 0 <= t < self.frames:
            raise ValueError(f"frame must be in [0, {self.frames - 1}], got {t}")
        return Scene(tuple(o for o in (m.at(t, self.frames) for m in self.objects) if o is not None))


def _apart(a: SceneObject, b: SceneObject, gap: float) -> bool:
    ax0, ay0, ax1, ay1 = a.box
    bx0, by0, bx1, by1 = b.box
    return ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0


def _mover(shape: str, colour: str, direction: Optional[str], rng: np.random.Generator,
           world: MovingWorld) -> MovingObject:
    """An object moving `direction` (None: still) by a uniform distance, starting where its whole path fits."""
    pic = world.picture
    size = float(rng.uniform(pic.min_size, pic.max_size))
    lo, hi = pic.margin + size / 2, pic.size - pic.margin - size / 2
    if direction is None:
        c = (float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi)))
        return MovingObject(shape, size, c, c, colour)
    dx, dy = DIRECTIONS[direction]
    move = float(rng.uniform(world.min_move, world.max_move))
    # the start on each axis: anywhere such that start + move * step stays in [lo, hi]
    sx = float(rng.uniform(lo - min(dx, 0) * move, hi - max(dx, 0) * move))
    sy = float(rng.uniform(lo - min(dy, 0) * move, hi - max(dy, 0) * move))
    return MovingObject(shape, size, (sx, sy), (sx + dx * move, sy + dy * move), colour)


def _first_left(objects: tuple[MovingObject, ...]) -> bool:
    a, b = ((o.start[0] + o.end[0]) / 2 for o in objects)
    return b - a >= FIRST_LEFT_GAP


def sample_clip_scene(spec: ClipSpec, rng: np.random.Generator, world: MovingWorld = DEFAULT_MOVING_WORLD,
                      max_tries: int = 2000, layout: str = "any") -> ClipScene:
    """A random scene holding exactly `spec`'s objects doing what it asks (the module doc); two objects are drawn
    again (at most `max_tries` times) until they keep `World.gap` apart in every frame and, in a two-motion scene,
    follow `layout` (the module doc; other categories ignore it)."""
    if layout not in TWO_MOTIONS_LAYOUTS:
        raise ValueError(f"layout must be one of {list(TWO_MOTIONS_LAYOUTS)}, got {layout!r}")
    placed = _first_left if layout == "first_left" and spec.tag == "two_motions" else (lambda objects: True)
    colours = world.colours

    def colour_of(c: Optional[str]) -> str:
        return c if c is not None else colours[int(rng.integers(len(colours)))]

    T = world.frames
    for _ in range(max_tries):
        if spec.tag in ("direction", "two_motions"):
            objects = tuple(_mover(a.shape, colour_of(a.colour), a.direction, rng, world) for a in spec.actors)
        elif spec.tag == "order":
            first = int(rng.choice(world.appear_frames))
            second = first + int(rng.integers(world.appear_gap[0], world.appear_gap[1] + 1))
            (a, b) = spec.actors
            objects = (replace(_mover(a.shape, a.colour, None, rng, world), appear=first),
                       replace(_mover(b.shape, b.colour, None, rng, world), appear=second))
        elif spec.tag == "change":
            (a,) = spec.actors
            still = _mover(a.shape, a.colour, None, rng, world)
            objects = (replace(still, becomes=a.becomes, change_frame=int(rng.choice(world.change_frames))),)
        else:
            raise ValueError(f"unknown tag {spec.tag!r}")
        if len(objects) < 2 or (all(_apart(p, q, world.picture.gap) for t in range(T)
                                    for p, q in [(objects[0].at(t, T), objects[1].at(t, T))]
                                    if p is not None and q is not None) and placed(objects)):
            return ClipScene(objects, T)
    raise SceneError(f"no placement of {spec.prompt!r} found in {max_tries} tries on a {world.size}px canvas")
