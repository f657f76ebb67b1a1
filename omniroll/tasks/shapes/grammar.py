"""The prompt grammar of the shapes world: GenEval's six categories, each prompt with GenEval's metadata.

    single_object  "a circle"
    two_object     "a circle and a square"                 (two different shapes)
    counting       "three squares"                         (exactly that many)
    colors         "a red circle"
    position       "a circle left of a square"             (left of, right of, above, below; two different shapes)
    color_attr     "a red circle and a blue triangle"      (two different shapes, two different colours)

`parse_prompt(text)` gives a `PromptSpec` (the tag and GenEval's `include` / `exclude` requirements) or raises
`PromptError`, which names the prompt and the nearest valid one. `all_prompts()` lists every prompt of a world in a
fixed order. `PromptSpec.key` is the prompt's requirement without its wording: "a circle and a square" and "a square
and a circle" share one key, as do "a circle left of a square" and "a square right of a circle" (the splits keep such
twins together, and a chance baseline must not pair them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omniroll.tasks import grammars
from omniroll.tasks.shapes.world import DEFAULT_WORLD, INVERSE_RELATION, NUMBER_WORDS, World

#: GenEval's category tags, in GenEval's order
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


class PromptError(ValueError):
    """A prompt outside the grammar; `nearest` is the closest valid prompt."""

    def __init__(self, prompt: str, nearest: str, reason: str = ""):
        self.prompt, self.nearest = prompt, nearest
        why = f" ({reason})" if reason else ""
        super().__init__(f"prompt {prompt!r} is not in the shapes grammar{why}; the nearest valid prompt is "
                         f"{nearest!r} (forms: 'a circle', 'a circle and a square', 'three squares', 'a red circle', "
                         f"'a circle left of a square', 'a red circle and a blue square')")


@dataclass(frozen=True)
class Requirement:
    """One GenEval `include` entry: at least `count` objects of `shape` (`colour`: of that colour; `position`:
    (relation, index of the target requirement), each of them in that relation to the target's objects)."""

    shape: str
    count: int = 1
    colour: Optional[str] = None
    position: Optional[tuple[str, int]] = None

    def metadata(self) -> dict:
        d: dict = {"class": self.shape, "count": self.count}
        if self.colour is not None:
            d["color"] = self.colour
        if self.position is not None:
            d["position"] = [self.position[0], self.position[1]]
        return d


@dataclass(frozen=True)
class PromptSpec:
    """A parsed prompt: its text, GenEval tag, `include` requirements and `exclude` limits ((shape, count): fewer
    than `count` such objects; the counting prompts' "exactly")."""

    prompt: str
    tag: str
    include: tuple[Requirement, ...]
    exclude: tuple[tuple[str, int], ...] = ()

    def metadata(self) -> dict:
        """GenEval's metadata line for this prompt."""
        d = {"tag": self.tag, "include": [r.metadata() for r in self.include], "prompt": self.prompt}
        if self.exclude:
            d["exclude"] = [{"class": s, "count": n} for s, n in self.exclude]
        return d

    @property
    def key(self) -> tuple:
        """The requirement without its wording (word order of "and", the mirror form of a relation)."""
        if self.tag == "position":
            target, mover = self.include[0].shape, self.include[1].shape
            rel = self.include[1].position[0]
            if rel in ("right of", "below"):  # "B right of A" is "A left of B"
                target, mover, rel = mover, target, INVERSE_RELATION[rel]
            return (self.tag, mover, rel, target)
        items = tuple(sorted((r.shape, r.count, r.colour or "") for r in self.include))
        return (self.tag, items, self.exclude)


# ------------------------------------------------------------------------------------------------ the grammar
def _a(word: str) -> str:
    return f"a {word}"


def all_prompts(world: World = DEFAULT_WORLD) -> list[str]:
    """Every prompt of the grammar, category by category in GenEval's order (a fixed, documented order)."""
    S, C = world.shapes, list(world.colours)
    out = [_a(s) for s in S]
    out += [f"{_a(s1)} and {_a(s2)}" for s1 in S for s2 in S if s1 != s2]
    out += [f"{NUMBER_WORDS[n]} {world.plural(s)}" for s in S for n in world.counts]
    out += [f"a {c} {s}" for s in S for c in C]
    out += [f"{_a(s1)} {rel} {_a(s2)}" for rel in world.relations for s1 in S for s2 in S if s1 != s2]
    out += [f"a {c1} {s1} and a {c2} {s2}" for s1 in S for s2 in S if s1 != s2
            for c1 in C for c2 in C if c1 != c2]
    return out


def _normalise(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


def _object(words: list[str], world: World) -> Optional[tuple[Optional[str], str]]:
    """["a", shape] or ["a", colour, shape] -> (colour, shape); None when it is neither."""
    if len(words) == 2 and words[0] == "a" and words[1] in world.shapes:
        return None, words[1]
    if len(words) == 3 and words[0] == "a" and words[1] in world.colours and words[2] in world.shapes:
        return words[1], words[2]
    return None


def _try_parse(text: str, world: World) -> Optional[PromptSpec]:
    w = text.split()
    one = _object(w, world)
    if one is not None:
        colour, shape = one
        return PromptSpec(text, "colors" if colour else "single_object", (Requirement(shape, 1, colour),))
    numbers = {v: k for k, v in NUMBER_WORDS.items() if k in world.counts}
    plurals = {world.plural(s): s for s in world.shapes}
    if len(w) == 2 and w[0] in numbers and w[1] in plurals:
        n, shape = numbers[w[0]], plurals[w[1]]
        return PromptSpec(text, "counting", (Requirement(shape, n),), ((shape, n + 1),))
    if "and" in w:
        i = w.index("and")
        a, b = _object(w[:i], world), _object(w[i + 1:], world)
        if a is None or b is None or a[1] == b[1]:
            return None
        if (a[0] is None) != (b[0] is None) or (a[0] is not None and a[0] == b[0]):
            return None
        tag = "two_object" if a[0] is None else "color_attr"
        return PromptSpec(text, tag, (Requirement(a[1], 1, a[0]), Requirement(b[1], 1, b[0])))
    for rel in world.relations:
        r = rel.split()
        for i in range(1, len(w) - len(r)):
            if w[i:i + len(r)] == r:
                mover, target = _object(w[:i], world), _object(w[i + len(r):], world)
                if mover is None or target is None or mover[0] or target[0] or mover[1] == target[1]:
                    return None
                # GenEval's order: the target first, the mover relative to requirement 0
                return PromptSpec(text, "position", (Requirement(target[1]), Requirement(mover[1], 1, None, (rel, 0))))
    return None


def parse_prompt(prompt: str, world: World = DEFAULT_WORLD) -> PromptSpec:
    """The `PromptSpec` of a grammar prompt (case, surrounding spaces and a final full stop are ignored);
    `PromptError` naming the nearest valid prompt for anything else."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    text = _normalise(prompt)
    spec = _try_parse(text, world)
    if spec is None:
        raise PromptError(prompt, nearest_prompt(text, world))
    return spec


def nearest_prompt(text: str, world: World = DEFAULT_WORLD) -> str:
    """The grammar prompt closest to `text` (by difflib's similarity of their words, then of their characters)."""
    return grammars.nearest_prompt(text, all_prompts(world), _normalise)


def check_prompts(prompts, world: World = DEFAULT_WORLD) -> list[str]:
    """One line per prompt outside the grammar (with its nearest valid form and its position in the list)."""
    return grammars.prompt_problems(prompts, lambda p: parse_prompt(p, world), (PromptError, TypeError))


def grammar_words(world: World = DEFAULT_WORLD) -> list[str]:
    """Every word the grammar uses (what the shapes model's tokenizers must know as whole tokens)."""
    return grammars.words_of(all_prompts(world))
