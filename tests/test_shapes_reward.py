"""The shapes rewards' one-category option (`kwargs: {category: <GenEval tag>}`, omniroll/reward/shapes.py): a sample
of the category gets its score and extras, a sample of another category the constant OUTSIDE (a tie within its
prompt group: no advantage), and a bad category is refused naming the field before anything runs."""

import numpy as np
import pytest

from omniroll.reward import RewardSample
from omniroll.reward.scorers import build_scorer, scorer_problems
from omniroll.reward.shapes import OUTSIDE
from omniroll.tasks.shapes.grammar import TAGS, parse_prompt
from omniroll.tasks.shapes.render import render
from omniroll.tasks.shapes.scene import sample_scene

PROMPTS = ["three squares", "a red circle", "a circle left of a square"]  # counting, colors, position


def _samples():
    rng = np.random.default_rng(0)
    return [RewardSample(f"s{i}", np.ascontiguousarray(render(sample_scene(parse_prompt(p), rng)).transpose(2, 0, 1)),
                         p) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("fn", ["shapes", "shapes_strict", "shapes_continuous"])
def test_one_category_scores_its_own_samples_and_a_constant_elsewhere(fn):
    samples = _samples()
    assert [parse_prompt(p).tag for p in PROMPTS] == ["counting", "colors", "position"]
    whole = build_scorer(fn)(samples)
    assert [w["score"] for w in whole] == [1.0, 1.0, 1.0]  # rendered scenes meet their prompts under every rule
    for k, tag in enumerate(("counting", "colors", "position")):
        got = build_scorer(fn, {"category": tag})(samples)
        assert got[k] == whole[k] and got[k][tag] == 1.0
        assert all(got[i] == {"score": OUTSIDE} for i in range(3) if i != k)  # no extras: not this category's
    assert all(s == {"score": OUTSIDE} for s in build_scorer(fn, {"category": "two_object"})(samples))


def test_a_bad_category_or_kwarg_is_refused_naming_the_field():
    assert scorer_problems("shapes", {"category": "count"}) == [f"kwargs.category: one of {', '.join(TAGS)}, got "
                                                                f"'count'"]
    assert scorer_problems("shapes_strict", {"size": 3}) == ["kwargs: 'shapes_strict' takes only category, got "
                                                             "['size']"]
    assert scorer_problems("shapes", {"category": "counting"}) == []
    with pytest.raises(ValueError, match="kwargs.category: one of single_object"):
        build_scorer("shapes_continuous", {"category": "colour"})
