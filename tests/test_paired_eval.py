"""The evaluation's statistics: standard errors beside every accuracy, the paired comparison of two evaluations at the
same prompts and seeds (flipped pictures, McNemar's z, the verdict), and the grids that mark the flipped pictures."""

import math

import numpy as np
import pytest

from omniroll.evaluation.paired import flips, mcnemar_z, paired, paired_table, verdict
from omniroll.tasks.shapes.report import Report, Scored, binomial_se, captioned_grid


def pictures(verdicts, tag="counting", prompt="three squares"):
    return [{"prompt": prompt, "seed": s, "tag": tag, "strict": v} for s, v in enumerate(verdicts)]


def test_mcnemar_z_and_the_verdict():
    assert mcnemar_z(28, 35) == pytest.approx(-7 / math.sqrt(63))  # the demo's 16-seed reading: z -0.9
    assert mcnemar_z(0, 0) == 0.0
    assert mcnemar_z(39, 16) == pytest.approx(3.1, abs=0.01)
    assert verdict(-0.88) == verdict(1.99) == "no detectable change"
    assert verdict(2.0) == "detectably better" and verdict(-2.5) == "detectably worse"


def test_paired_counts_the_flips_per_category_and_overall():
    base = pictures([0, 0, 1, 1, 0, 1]) + pictures([1, 0, 0], tag="position", prompt="a circle left of a square")
    new = pictures([1, 0, 1, 0, 1, 1]) + pictures([1, 1, 1], tag="position", prompt="a circle left of a square")
    cmp = paired(base, new)
    assert cmp["categories"]["counting"] == {"up": 2, "down": 1, "n": 6, "z": pytest.approx(1 / math.sqrt(3)),
                                             "verdict": "no detectable change"}
    assert cmp["categories"]["position"]["up"] == 2 and cmp["categories"]["position"]["down"] == 0
    assert cmp["overall"]["up"] == 4 and cmp["overall"]["down"] == 1 and cmp["overall"]["n"] == 9
    assert flips(base, new) == {("three squares", 0): "up", ("three squares", 3): "down",
                                ("three squares", 4): "up", ("a circle left of a square", 1): "up",
                                ("a circle left of a square", 2): "up"}
    # pairing is by (prompt, seed), not by position in the list
    assert paired(base[::-1], new) == cmp


def test_paired_refuses_pictures_that_are_not_the_same_prompts_and_seeds():
    with pytest.raises(ValueError, match="same prompts and seeds.*1 picture"):
        paired(pictures([1, 0, 1]), pictures([1, 0]))


def test_report_standard_errors_are_binomial_per_category_and_propagated_to_the_overall_mean():
    rows = ([Scored("a circle", "single_object", s, 1.0 if s else 0.0, False) for s in [1, 1, 1, 0]]
            + [Scored("three squares", "counting", s, 1.0 if s else 0.0, False) for s in [1, 0]])
    rep = Report.from_rows(rows)
    assert rep.categories["single_object"]["se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert rep.categories["counting"]["se"] == pytest.approx(math.sqrt(0.25 / 2))
    assert rep.overall["se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4 + 0.25 / 2) / 2)
    assert binomial_se(1.0, 10) == 0.0 and math.isnan(binomial_se(0.5, 0))
    assert "+- se" in rep.table() and "eval/x/se" in rep.flat("eval/x")
    base = {"categories": {"counting": {"strict": 0.5, "se": 0.1}}, "overall": {"strict": 0.5, "se": 0.1}}
    new = {"categories": {"counting": {"strict": 0.6, "se": 0.1}}, "overall": {"strict": 0.6, "se": 0.1}}
    text = paired_table(paired(pictures([0, 1]), pictures([1, 1])), base, new)
    assert "counting" in text and "no detectable change: 1 picture(s) fail -> pass, 0 pass -> fail" in text


def test_grid_marks_flipped_pictures_with_a_frame_and_passes_with_a_glyph():
    red = np.zeros((8, 8, 3), np.uint8)
    red[..., 0] = 200
    plain = captioned_grid([red, red], ["a", "b"], [True, False], columns=2)
    marked = captioned_grid([red, red], ["a", "b"], [True, False], columns=2, marks=["up", None])
    assert plain.shape == marked.shape
    w = 16  # 8 px x scale 2
    first, second = (slice(0, w), slice(0, w)), (slice(0, w), slice(w + 6, 2 * w + 6))
    assert (plain[first] != marked[first]).any()  # the flipped picture is framed
    assert (plain[second] == marked[second]).all()  # the unchanged one is not
