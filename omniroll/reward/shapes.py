"""The shapes world's rewards: GenEval's rules on an exact checker (`omniroll.tasks.shapes`), usable as
`reward.functions.<name>.fn: shapes` (partial credit, for RL), `shapes_continuous` (the same terms graded: outline
fit, colour share, position margin) or `shapes_strict` (GenEval's pass / fail).

Each returns, per sample, a dict: `score` (the reward) and extras that land in the row's `extra_info` as
`<name>/<key>` and that the trainer averages per step (so the trackers plot them): `strict`, `partial` and
`continuous` of every sample, and `<category>` (its strict pass) for the sample's own category only, so each
category's mean is taken over that category's samples. A prompt outside the grammar is that row's error, naming the
nearest valid prompt (the row fails, the others are scored; never a reward of 0); `check_prompts` finds such prompts
before anything starts.
"""

from __future__ import annotations

from omniroll.tasks.shapes.grammar import check_prompts as grammar_problems
from omniroll.tasks.shapes.grammar import PromptError, parse_prompt
from omniroll.reward.task_scorers import task_scorer
from omniroll.tasks.shapes.report import score_picture


def _values(samples, score: str) -> list:
    """One dict per sample; a sample that cannot be scored (a prompt outside the grammar, a video) gets its error
    instance, which fails that row alone (`RewardManager`)."""
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


#: registry name -> factory (added to `omniroll.reward.scorers.SCORER_REGISTRY`)
SHAPES_SCORERS = {name: task_scorer(fn, grammar_problems, "the shapes rewards") for name, fn in (
    ("shapes", shapes_partial), ("shapes_continuous", shapes_continuous), ("shapes_strict", shapes_strict))}
