"""The fixed prompt splits of the shapes world: `train` (what pretraining and RL see) and `heldout` (requirements
neither ever sees, to measure generalisation).

A requirement goes to `heldout` by a fixed rule, not by chance, so the split reads in one line per category and
never changes:

    single_object  none (three prompts, not a combination)
    two_object     the circle + triangle pair                                  (1 of 3 requirements)
    counting       count index n, shape index s with (n + s) % 3 == 1           (3 of 9: three circles, two squares,
                                                                                  four triangles)
    colors         colour index i, shape index s with (i + s) % 4 == 3          (4 of 18: blue circle, green square,
                                                                                  yellow and black triangle)
    position       relation index r, shape indices a, b with (r + a + b) % 4 == 3  (4 of 12 requirements: square and
                                                                                  triangle side by side, circle and
                                                                                  square one above the other)
    color_attr     colour indices i, k, shape indices a, b with (i + 2k + a + b) % 5 == 4  (18 of 90 requirements)

Indices are positions in `World.shapes` (circle 0, square 1, triangle 2), `World.colours` (red 0 ... black 5),
`World.counts` and `World.relations` (left of 0, right of 1, above 2, below 3) of the default world. Of the 240
prompts, 187 are for training and 53 held out.

Both wordings of a requirement ("a circle and a square" / "a square and a circle", "A left of B" / "B right of A")
fall on the same side. `split_prompts(name)` lists a split's prompts in the grammar's order.
"""

from __future__ import annotations

from omniroll.tasks.shapes.grammar import PromptSpec, all_prompts, parse_prompt
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World

SPLITS = ("train", "heldout", "all")


def is_heldout(spec: PromptSpec, world: World = DEFAULT_WORLD) -> bool:
    """Whether the prompt's requirement is held out (the rule in the module doc; it reads the requirement, not the
    wording, so twins agree)."""
    shape = {s: i for i, s in enumerate(world.shapes)}
    colour = {c: i for i, c in enumerate(world.colours)}
    key = spec.key
    if spec.tag == "single_object":
        return False
    if spec.tag == "two_object":
        return sorted(shape[s] for s, _, _ in key[1]) == sorted((0, len(world.shapes) - 1))
    if spec.tag == "counting":
        (s, n, _), = key[1]
        return (world.counts.index(n) + shape[s]) % 3 == 1
    if spec.tag == "colors":
        (s, _, c), = key[1]
        return (colour[c] + shape[s]) % 4 == 3
    if spec.tag == "position":
        _, mover, rel, target = key
        return (world.relations.index(rel) + shape[mover] + shape[target]) % 4 == 3
    if spec.tag == "color_attr":
        (s1, _, c1), (s2, _, c2) = key[1]
        return (colour[c1] + 2 * colour[c2] + shape[s1] + shape[s2]) % 5 == 4
    raise ValueError(f"unknown tag {spec.tag!r}")


def split_prompts(split: str, world: World = DEFAULT_WORLD) -> list[str]:
    """The prompts of `split` ("train", "heldout" or "all"), in the grammar's order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    prompts = all_prompts(world)
    if split == "all":
        return prompts
    want = split == "heldout"
    return [p for p in prompts if is_heldout(parse_prompt(p, world), world) == want]


def prompts_of(which: str, world: World = DEFAULT_WORLD) -> list[str]:
    """A split's prompts ("train", "heldout", "all"), or those of a file of one grammar prompt per line (blank lines
    skipped; ValueError naming every line outside the grammar, with its nearest valid prompt)."""
    import os

    from omniroll.tasks import grammars
    from omniroll.tasks.shapes.grammar import PromptError

    if which in SPLITS:
        return split_prompts(which, world)
    if not os.path.isfile(which):
        raise FileNotFoundError(f"expected one of {list(SPLITS)} or a file of prompts, got {which!r} (no such file)")
    return grammars.read_prompt_file(which, lambda line: parse_prompt(line, world), (PromptError,))
