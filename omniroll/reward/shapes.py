"""The shapes world's rewards: GenEval's rules on an exact checker (`omniroll.tasks.shapes`), usable as
`reward.functions.<name>.fn: shapes` (partial credit, for RL), `shapes_continuous` (the same terms graded: outline
fit, colour share, position margin) or `shapes_strict` (GenEval's pass / fail).

Each returns, per sample, a dict: `score` (the reward) and extras that land in the row's `extra_info` as
`<name>/<key>` and that the trainer averages per step (so the trackers plot them): `strict`, `partial` and
`continuous` of every sample, and `<category>` (its strict pass) for the sample's own category only, so each
category's mean is taken over that category's samples. A prompt outside the grammar is that row's error, naming the
nearest valid prompt (the row fails, the others are scored; never a reward of 0); `check_prompts` finds such prompts
before anything starts.

`kwargs: {category: <GenEval tag>}` scores one category only (the six categories as six reward functions, MARBLE's
measurement: benchmarks/reward_components.py): a sample of that category gets its score and extras as above, a
sample of another category the constant `OUTSIDE` (0.0) and no extras. A prompt group shares its prompt, so the
constant ties within the group: it gives those samples no advantage under either `reward.aggregation` (it is not a
verdict on them, and their own category's function scores them).
"""

from __future__ import annotations

from omniroll.tasks.shapes.grammar import check_prompts as grammar_problems
from omniroll.tasks.shapes.grammar import TAGS, PromptError, parse_prompt
from omniroll.tasks.shapes.report import score_picture

#: the score a one-category function (`kwargs: {category: ...}`) gives a sample of another category
OUTSIDE = 0.0


def _values(samples, score: str, category: str | None = None) -> list:
    """One dict per sample; a sample that cannot be scored (a prompt outside the grammar, a video) gets its error
    instance, which fails that row alone (`RewardManager`). `category`: score that category only (module doc)."""
    out = []
    for s in samples:
        if s.is_video:
            out.append(ValueError(f"sample {s.sample_id!r} is a video; the shapes reward scores images"))
            continue
        try:
            spec = parse_prompt(s.prompt)
        except PromptError as e:
            out.append(e)
            continue
        if category is not None and spec.tag != category:
            out.append({"score": OUTSIDE})
            continue
        j = score_picture(spec, s.image)
        strict = float(j.strict)
        values = {"strict": strict, "partial": j.partial, "continuous": j.continuous}
        out.append({"score": values[score], **values, spec.tag: strict})
    return out


def shapes_partial(samples) -> list[dict]:
    """Partial credit in [0, 1]: the share of the prompt's requirements the picture meets (`omniroll.tasks.shapes.
    judge`)."""
    return _values(samples, "partial")


def shapes_continuous(samples) -> list[dict]:
    """Continuous credit in [0, 1]: partial credit's terms graded by how nearly each is met (`omniroll.tasks.shapes.
    judge`), so that a picture nearer a pass earns more even when no requirement flips."""
    return _values(samples, "continuous")


def shapes_strict(samples) -> list[dict]:
    """GenEval's strict success: 1.0 when the picture meets every requirement, else 0.0."""
    return _values(samples, "strict")


def _factory(fn, score: str):
    """The registry factory of one shapes reward: `fn` itself, or with `category` that category's function."""

    def check_kwargs(kwargs: dict) -> list[str]:
        extra = sorted(set(kwargs) - {"category"})
        if extra:
            return [f"kwargs: {fn.__name__!r} takes only category, got {extra}"]
        cat = kwargs.get("category")
        if cat is not None and cat not in TAGS:
            return [f"kwargs.category: one of {', '.join(TAGS)}, got {cat!r}"]
        return []

    def factory(**kwargs):
        problems = check_kwargs(kwargs)
        if problems:
            raise ValueError(f"reward scorer {fn.__name__!r}: " + "; ".join(problems))
        category = kwargs.get("category")
        if category is None:
            return fn

        def one_category(samples):
            return _values(samples, score, category)

        one_category.__name__ = f"{fn.__name__}_{category}"
        return one_category

    factory.check_kwargs = check_kwargs
    factory.check_prompts = grammar_problems
    return factory


#: registry name -> factory (added to `omniroll.reward.scorers.SCORER_REGISTRY`)
SHAPES_SCORERS = {name: _factory(fn, score) for name, fn, score in (
    ("shapes", shapes_partial, "partial"), ("shapes_continuous", shapes_continuous, "continuous"),
    ("shapes_strict", shapes_strict, "strict"))}
