"""The shapes world's vocabulary: canvas, background, colours, shape kinds, counts and relations (`World`).

Everything else in `omniroll.tasks.shapes` (the grammar, the scene sampler, the renderer, the checker) reads its words
and numbers from a `World`, so a new colour, shape, count or relation is one edit here (a new shape kind also needs
its outline in `outlines.py`). `DEFAULT_WORLD` is the world the shipped `--model shapes` was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RGB = tuple[int, int, int]

#: number words of the counting prompts
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def _default_colours() -> dict[str, RGB]:
    # six saturated colours far from each other and from the background (the closest pair, blue / purple, is ~150
    # apart in RGB; every colour is >= 200 from the background)
    return {"red": (215, 35, 35), "yellow": (240, 195, 20), "green": (35, 160, 60), "blue": (40, 90, 225),
            "purple": (155, 45, 185), "black": (25, 25, 25)}


@dataclass(frozen=True)
class World:
    """size: the square canvas in pixels. background: its plain light colour. colours: name -> RGB, in prompt order.
    shapes: the shape kinds (each needs an outline in `outlines.OUTLINES`). counts: the numbers of the counting
    prompts. relations: GenEval's position words. min_size / max_size: an object's box side in pixels. gap: the least
    distance in pixels between two objects' boxes (so objects never touch). margin: from the canvas edge."""

    size: int = 64
    background: RGB = (244, 242, 236)
    colours: dict[str, RGB] = field(default_factory=_default_colours)
    shapes: tuple[str, ...] = ("circle", "square", "triangle")
    counts: tuple[int, ...] = (2, 3, 4)
    relations: tuple[str, ...] = ("left of", "right of", "above", "below")
    min_size: float = 14.0
    max_size: float = 22.0
    gap: float = 4.0
    margin: float = 2.0

    def __post_init__(self):
        from omniroll.tasks.shapes.outlines import OUTLINES

        unknown = [s for s in self.shapes if s not in OUTLINES]
        if unknown:
            raise ValueError(f"World.shapes: no outline for {unknown} (known: {sorted(OUTLINES)})")
        bad_rel = [r for r in self.relations if r not in INVERSE_RELATION]
        if bad_rel:
            raise ValueError(f"World.relations: unknown {bad_rel} (allowed: {sorted(INVERSE_RELATION)})")
        if not self.counts or min(self.counts) < 2 or max(self.counts) not in NUMBER_WORDS:
            raise ValueError(f"World.counts must be numbers in [2, {max(NUMBER_WORDS)}], got {self.counts}")
        if len(self.colours) < 2 or len(self.shapes) < 2:
            raise ValueError("World needs at least two colours and two shapes")
        if not 4 <= self.min_size <= self.max_size <= self.size / 2:
            raise ValueError(f"World sizes must satisfy 4 <= min_size <= max_size <= size / 2, got "
                             f"{self.min_size}, {self.max_size}, {self.size}")

    def plural(self, shape: str) -> str:
        return shape + "s"


#: GenEval's relations and their mirror images ("A left of B" is "B right of A")
INVERSE_RELATION = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

DEFAULT_WORLD = World()
