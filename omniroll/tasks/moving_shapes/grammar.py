"""The prompt grammar of the moving-shapes world: four temporal categories, each needing the whole clip, and every
prompt's antithetic twin.

    direction    "a red circle moving left"                          (one object; left, right, up, down)
    two_motions  "a square moving up and a triangle moving down"     (two different shapes, each its own direction)
    order        "a red circle appears, then a blue square"          (the clip opens empty; different shapes and
                                                                       colours; the first stays when the second comes)
    change       "a square turning from blue to green"               (one object, two different colours)

`parse_prompt(text)` gives a `ClipSpec` (the tag and its `Actor`s) or raises `PromptError`, which names the prompt and
the nearest valid one. `all_prompts()` lists every prompt of a world in a fixed order. `twin_prompt(p)` is the prompt's
antithetic twin: the same objects with what happens in time reversed (the opposite direction, both directions
reversed, the order swapped, the colours swapped); no clip satisfies a prompt and its twin, and a static clip
satisfies neither. `ClipSpec.key` is the requirement without its wording ("A moving up and B moving down" and "B
moving down and A moving up" share one key).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from omniroll.tasks import grammars
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, OPPOSITE, MovingWorld

#: the categories, in the grammar's order
TAGS = ("direction", "two_motions", "order", "change")
#: one example of each form (for error messages and the docs)
FORMS = ("a red circle moving left", "a square moving up and a triangle moving down",
         "a red circle appears, then a blue square", "a square turning from blue to green")


class PromptError(ValueError):
    """A prompt outside the grammar; `nearest` is the closest valid prompt."""

    def __init__(self, prompt: str, nearest: str, reason: str = ""):
        self.prompt, self.nearest = prompt, nearest
        why = f" ({reason})" if reason else ""
        forms = ", ".join(repr(f) for f in FORMS)
        super().__init__(f"prompt {prompt!r} is not in the moving-shapes grammar{why}; the nearest valid prompt is "
                         f"{nearest!r} (forms: {forms})")


@dataclass(frozen=True)
class Actor:
    """One object a prompt names: its shape; `colour` (direction, order: its colour; change: the colour it starts
    with; None: any); `direction` (direction, two_motions: where it moves); `becomes` (change: the colour it ends
    with)."""

    shape: str
    colour: Optional[str] = None
    direction: Optional[str] = None
    becomes: Optional[str] = None

    def words(self) -> str:
        """"a circle", "a red circle" (the object's words in a prompt)."""
        return " ".join(w for w in ("a", self.colour, self.shape) if w)


@dataclass(frozen=True)
class ClipSpec:
    """A parsed prompt: its canonical text, category tag and actors (order: in order of appearance)."""

    prompt: str
    tag: str
    actors: tuple[Actor, ...]

    @property
    def key(self) -> tuple:
        """The requirement without its wording (the word order of a two-motion prompt's "and")."""
        actors = self.actors
        if self.tag == "two_motions":
            actors = tuple(sorted(actors, key=lambda a: (a.shape, a.direction)))
        return (self.tag, actors)

    def metadata(self) -> dict:
        """The requirement as plain data (for evaluation files)."""
        return {"tag": self.tag, "prompt": self.prompt,
                "actors": [{k: v for k, v in vars(a).items() if v is not None} for a in self.actors]}


def prompt_text(tag: str, actors: tuple[Actor, ...]) -> str:
    """The canonical prompt of a category and its actors."""
    if tag == "direction":
        (a,) = actors
        return f"{a.words()} moving {a.direction}"
    if tag == "two_motions":
        return " and ".join(f"{a.words()} moving {a.direction}" for a in actors)
    if tag == "order":
        first, second = actors
        return f"{first.words()} appears, then {second.words()}"
    if tag == "change":
        (a,) = actors
        return f"a {a.shape} turning from {a.colour} to {a.becomes}"
    raise ValueError(f"tag must be one of {list(TAGS)}, got {tag!r}")


def all_specs(world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[ClipSpec]:
    """Every prompt's spec, category by category in `TAGS` order (a fixed, documented order)."""
    S, C, D = world.shapes, world.colours, world.directions
    groups = {
        "direction": [(Actor(s, c, d),) for s in S for c in C for d in D],
        "two_motions": [(Actor(s1, None, d1), Actor(s2, None, d2)) for s1 in S for s2 in S if s1 != s2
                        for d1 in D for d2 in D],
        "order": [(Actor(s1, c1), Actor(s2, c2)) for s1 in S for s2 in S if s1 != s2
                  for c1 in C for c2 in C if c1 != c2],
        "change": [(Actor(s, c1, None, c2),) for s in S for c1 in C for c2 in C if c1 != c2],
    }
    return [ClipSpec(prompt_text(tag, actors), tag, actors) for tag in TAGS for actors in groups[tag]]


def all_prompts(world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[str]:
    """Every prompt of the grammar, in `all_specs`' order."""
    return [s.prompt for s in all_specs(world)]


def twin_spec(spec: ClipSpec) -> ClipSpec:
    """The antithetic twin (the module doc): the same objects, what happens in time reversed."""
    if spec.tag in ("direction", "two_motions"):
        actors = tuple(replace(a, direction=OPPOSITE[a.direction]) for a in spec.actors)
    elif spec.tag == "order":
        actors = spec.actors[::-1]
    elif spec.tag == "change":
        (a,) = spec.actors
        actors = (replace(a, colour=a.becomes, becomes=a.colour),)
    else:
        raise ValueError(f"unknown tag {spec.tag!r}")
    return ClipSpec(prompt_text(spec.tag, actors), spec.tag, actors)


def twin_prompt(prompt: str, world: MovingWorld = DEFAULT_MOVING_WORLD) -> str:
    """The antithetic twin of a grammar prompt ("a red circle moving left" -> "a red circle moving right")."""
    return twin_spec(parse_prompt(prompt, world)).prompt


# ------------------------------------------------------------------------------------------------ the parser
def _normalise(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").replace(",", " ").split())


def _object(words: list[str], world: MovingWorld, coloured: bool) -> Optional[Actor]:
    """["a", shape] (coloured=False) or ["a", colour, shape] (coloured=True) -> an Actor; None otherwise."""
    if not coloured and len(words) == 2 and words[0] == "a" and words[1] in world.shapes:
        return Actor(words[1])
    if coloured and len(words) == 3 and words[0] == "a" and words[1] in world.colours and words[2] in world.shapes:
        return Actor(words[2], words[1])
    return None


def _moving(words: list[str], world: MovingWorld, coloured: bool) -> Optional[Actor]:
    """[<object>, "moving", direction] -> an Actor with its direction."""
    if len(words) < 2 or words[-2] != "moving" or words[-1] not in world.directions:
        return None
    a = _object(words[:-2], world, coloured)
    return None if a is None else replace(a, direction=words[-1])


def _try_parse(w: list[str], world: MovingWorld) -> tuple[Optional[tuple[str, tuple[Actor, ...]]], str]:
    """(tag, actors) or (None, the reason when the form is recognised but its content is not allowed)."""
    if "and" in w:
        i = w.index("and")
        a, b = _moving(w[:i], world, False), _moving(w[i + 1:], world, False)
        if a is None or b is None:
            return None, ""
        return ((None, "the two objects must be different shapes") if a.shape == b.shape
                else (("two_motions", (a, b)), ""))
    if w[-2:-1] == ["moving"]:
        a = _moving(w, world, True)
        return (None, "") if a is None else (("direction", (a,)), "")
    if "appears" in w:
        i = w.index("appears")
        if w[i + 1:i + 2] != ["then"]:
            return None, ""
        a, b = _object(w[:i], world, True), _object(w[i + 2:], world, True)
        if a is None or b is None:
            return None, ""
        if a.shape == b.shape or a.colour == b.colour:
            return None, "the two objects must differ in shape and in colour"
        return ("order", (a, b)), ""
    if len(w) == 7 and w[0] == "a" and w[1] in world.shapes and w[2:4] == ["turning", "from"] and w[5] == "to" \
            and w[4] in world.colours and w[6] in world.colours:
        if w[4] == w[6]:
            return None, "the two colours must differ"
        return ("change", (Actor(w[1], w[4], None, w[6]),)), ""
    return None, ""


def parse_prompt(prompt: str, world: MovingWorld = DEFAULT_MOVING_WORLD) -> ClipSpec:
    """The `ClipSpec` of a grammar prompt (case, surrounding spaces, commas and a final full stop are forgiven; the
    spec's `prompt` is the canonical text); `PromptError` naming the nearest valid prompt for anything else."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    text = _normalise(prompt)
    parsed, reason = _try_parse(text.split(), world) if text else (None, "")
    if parsed is None:
        raise PromptError(prompt, nearest_prompt(text, world), reason)
    tag, actors = parsed
    return ClipSpec(prompt_text(tag, actors), tag, actors)


def nearest_prompt(text: str, world: MovingWorld = DEFAULT_MOVING_WORLD) -> str:
    """The grammar prompt closest to `text` (by difflib's similarity of their words, then of their characters)."""
    return grammars.nearest_prompt(text, all_prompts(world), _normalise)


def check_prompts(prompts, world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[str]:
    """One line per prompt outside the grammar (with its nearest valid form and its position in the list)."""
    return grammars.prompt_problems(prompts, lambda p: parse_prompt(p, world), (PromptError, TypeError))


def grammar_words(world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[str]:
    """Every word the grammar uses (what a model's tokenizers must know as whole tokens)."""
    return grammars.words_of(all_prompts(world))
