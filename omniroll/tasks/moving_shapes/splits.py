"""The fixed prompt splits of the moving-shapes world: `train` (what pretraining and RL see) and `heldout`
(requirement combinations neither ever sees, to measure generalisation).

A requirement goes to `heldout` by a fixed rule, not by chance, so the split reads in one line per category and
never changes; every word of the grammar is still seen in training, only the combinations are new:

    direction    shape index s, direction index d with (s + d) % 4 == 3      (3 of the 12 shape + direction pairs, in
                                                                             every colour: a circle moving down, a
                                                                             square moving up, a triangle moving right)
    two_motions  shape indices a < b moving da, db with (a + b + da + 2 db) % 5 == 4   (10 of 48 requirements)
    order        first (shape s1, colour c1), then (s2, c2) with (c1 + 2 c2 + s1 + s2) % 5 == 4  (36 of 180)
    change       the colour pair (from f, to t) with (f + 2 t) % 5 == 4      (6 of the 30 colour changes, in every
                                                                             shape: red to green, yellow to purple,
                                                                             green to yellow, purple to red, purple to
                                                                             black, black to green)

Indices are positions in the default world's `shapes` (circle 0, square 1, triangle 2), colours (red 0, yellow 1,
green 2, blue 3, purple 4, black 5) and `directions` (left 0, right 1, up 2, down 3). Of the 438 prompts, 346 are
for training and 92 held out. Both wordings of a two-motion requirement fall on the same side. `split_prompts(name)`
lists a split's prompts in the grammar's order; `prompts_of(name_or_file)` also reads a file of prompts.
"""

from __future__ import annotations

from omniroll.tasks.moving_shapes.grammar import ClipSpec, all_specs
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld

SPLITS = ("train", "heldout", "all")


def is_heldout(spec: ClipSpec, world: MovingWorld = DEFAULT_MOVING_WORLD) -> bool:
    """Whether the prompt's requirement is held out (the rule in the module doc; it reads the requirement, not the
    wording, so both wordings agree)."""
    shape = {s: i for i, s in enumerate(world.shapes)}
    colour = {c: i for i, c in enumerate(world.colours)}
    direction = {d: i for i, d in enumerate(world.directions)}
    if spec.tag == "direction":
        (a,) = spec.actors
        return (shape[a.shape] + direction[a.direction]) % 4 == 3
    if spec.tag == "two_motions":
        first, second = sorted(spec.actors, key=lambda x: shape[x.shape])
        return (shape[first.shape] + shape[second.shape] + direction[first.direction]
                + 2 * direction[second.direction]) % 5 == 4
    if spec.tag == "order":
        first, second = spec.actors
        return (colour[first.colour] + 2 * colour[second.colour] + shape[first.shape] + shape[second.shape]) % 5 == 4
    if spec.tag == "change":
        (a,) = spec.actors
        return (colour[a.colour] + 2 * colour[a.becomes]) % 5 == 4
    raise ValueError(f"unknown tag {spec.tag!r}")


def split_prompts(split: str, world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[str]:
    """The prompts of `split` ("train", "heldout" or "all"), in the grammar's order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    specs = all_specs(world)
    if split == "all":
        return [s.prompt for s in specs]
    want = split == "heldout"
    return [s.prompt for s in specs if is_heldout(s, world) == want]


def prompts_of(which: str, world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[str]:
    """A split's prompts ("train", "heldout", "all"), or those of a file of one grammar prompt per line (blank lines
    skipped; each prompt in its canonical form; ValueError naming every line outside the grammar, with its nearest
    valid prompt)."""
    import os

    from omniroll.tasks import grammars
    from omniroll.tasks.moving_shapes.grammar import PromptError, parse_prompt

    if which in SPLITS:
        return split_prompts(which, world)
    if not os.path.isfile(which):
        raise FileNotFoundError(f"expected one of {list(SPLITS)} or a file of prompts, got {which!r} (no such file)")
    return grammars.read_prompt_file(which, lambda line: parse_prompt(line, world), (PromptError,))
