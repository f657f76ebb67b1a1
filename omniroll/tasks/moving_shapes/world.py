"""The moving-shapes world's vocabulary: frames per clip, directions, move distances and appearance / change timing,
on top of the shapes world's pictures (`MovingWorld`).

A clip is `frames` pictures of the shapes world (its canvas, background, colours and shape kinds: `World`, by
composition), in which what the prompt asks happens in time. Everything else in `omniroll.tasks.moving_shapes` (the
grammar, the scene sampler, the renderer, the checker) reads its words and numbers from a `MovingWorld`.
`DEFAULT_MOVING_WORLD` is 9 frames at 64x64, objects of 14-18 px moving 24-40 px over the clip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniroll.tasks.shapes.world import World

#: the directions of the motion prompts and their unit steps (x right, y down: image axes)
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
#: each direction's opposite (a motion prompt's twin)
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def _picture_world() -> World:
    # the shapes world's colours, shapes and canvas, with objects small enough to travel 40 px across 64 px (at
    # 12 px a circle off the pixel grid can read as a square; the shapes world's pictures start at 14 px)
    return World(min_size=14.0, max_size=18.0)


@dataclass(frozen=True)
class MovingWorld:
    """picture: the shapes world every frame is drawn in (canvas, background, colours, shape kinds, object sizes,
    gap and margin). frames: pictures per clip. directions: the motion words (each in `DIRECTIONS`). min_move /
    max_move: how far a moving object travels from the first frame to the last, in pixels (a straight line at
    constant speed). appear_frames: the frames at which an order prompt's first object may appear (the clip opens
    empty). appear_gap: (least, most) frames between the first object's appearance and the second's. change_frames:
    the frames at which a change prompt's object may take its second colour (it keeps it to the end)."""

    picture: World = field(default_factory=_picture_world)
    frames: int = 9
    directions: tuple[str, ...] = ("left", "right", "up", "down")
    min_move: float = 24.0
    max_move: float = 40.0
    appear_frames: tuple[int, ...] = (1, 2, 3)
    appear_gap: tuple[int, int] = (2, 3)
    change_frames: tuple[int, ...] = (3, 4, 5, 6)

    def __post_init__(self):
        if not 5 <= self.frames <= 64:
            raise ValueError(f"MovingWorld.frames must be in [5, 64], got {self.frames}")
        bad = [d for d in self.directions if d not in DIRECTIONS]
        if bad or len(set(self.directions)) != len(self.directions) or not self.directions:
            raise ValueError(f"MovingWorld.directions: unknown or repeated {self.directions} (allowed: "
                             f"{list(DIRECTIONS)})")
        if any(OPPOSITE[d] not in self.directions for d in self.directions):
            raise ValueError(f"MovingWorld.directions must hold each direction's opposite (a prompt's twin), got "
                             f"{self.directions}")
        room = self.picture.size - 2 * self.picture.margin - self.picture.max_size
        if not 0 < self.min_move <= self.max_move <= room:
            raise ValueError(f"MovingWorld moves must satisfy 0 < min_move <= max_move <= {room:g} (the canvas less "
                             f"margins and the largest object), got {self.min_move}, {self.max_move}")
        lo, hi = self.appear_gap
        if not self.appear_frames or min(self.appear_frames) < 1 or not 1 <= lo <= hi \
                or max(self.appear_frames) + hi > self.frames - 3:
            raise ValueError(f"MovingWorld.appear_frames / appear_gap: the first object appears at frame >= 1 and "
                             f"the second at least 3 frames before the end ({self.frames} frames), got "
                             f"{self.appear_frames}, {self.appear_gap}")
        if not self.change_frames or min(self.change_frames) < 3 or max(self.change_frames) > self.frames - 3:
            raise ValueError(f"MovingWorld.change_frames must lie in [3, frames - 3] = [3, {self.frames - 3}], got "
                             f"{self.change_frames}")

    @property
    def size(self) -> int:
        return self.picture.size

    @property
    def colours(self) -> list[str]:
        return list(self.picture.colours)

    @property
    def shapes(self) -> tuple[str, ...]:
        return self.picture.shapes


DEFAULT_MOVING_WORLD = MovingWorld()
