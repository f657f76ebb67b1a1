"""The evaluation's statistics: standard errors beside every accuracy, the paired comparison of two evaluations at the
same prompts and seeds (flipped pictures, McNemar's z, the verdict), and the grids that mark the flipped pictures."""

import json
import math
import os

import numpy as np
import pytest

from omniroll.evaluation.paired import (extra_objects, extra_objects_line, flips, mcnemar_z, paired,
                                       paired_table, verdict)
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


def test_extra_objects_pair_like_verdicts_and_strict_with_no_extra_object_is_paired_too():
    """Seeds 0-5: extra objects appear on 0, 1 and 2 and go on 3; strict passes gained on 0 (with an extra object)
    and 4 (without): the strict verdict reads two up, the clean one only one."""
    base = [dict(p, extra=e) for p, e in zip(pictures([0, 1, 0, 1, 0, 1]), [0, 0, 0, 1, 0, 0])]
    new = [dict(p, extra=e) for p, e in zip(pictures([1, 1, 0, 1, 1, 1]), [1, 1, 1, 0, 0, 0])]
    assert paired(base, new)["overall"]["up"] == 2
    extra = extra_objects(base, new)
    assert extra["before"] == pytest.approx(1 / 6) and extra["after"] == pytest.approx(3 / 6)
    assert (extra["gained"], extra["lost"], extra["n"]) == (3, 1, 6) and extra["z"] == pytest.approx(mcnemar_z(3, 1))
    # clean (strict, no extra): before [0, 1, 0, 0, 0, 1], after [0, 0, 0, 1, 1, 1]
    assert (extra["clean"]["up"], extra["clean"]["down"]) == (2, 1)
    line = extra_objects_line(extra, "clip")
    assert line.startswith("extra objects: 16.7 % -> 50.0 % of clips (3 gained one, 1 lost one, McNemar z = +1.00)")
    assert "strict with no extra object: no detectable change: 2 clip(s) fail -> pass, 1 pass -> fail" in line
    assert extra_objects(pictures([1, 0]), pictures([1, 1])) is None  # not judged for extra objects


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


def _eval(tmp_path, name, *flags):
    """`omniroll eval` of the shipped model's two prompts at 2 seeds into tmp_path/name: (its eval.json, the
    directory)."""
    from omniroll.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("three circles\na red circle\n")
    out = tmp_path / name
    assert main(["eval", "--model", "shapes", "--prompts", str(prompts), "--seeds", "2", "--out", str(out),
                 "--quiet", *flags]) == 0
    with open(out / "eval.json") as f:
        return json.load(f), out


def test_a_baseline_of_another_model_at_another_guidance_is_drawn_as_that_model_draws_and_paired(tmp_path, capsys):
    """`--baseline-model M --baseline-guidance G`: the baseline is M with its own sampling defaults at CFG G (what
    `omniroll eval --model M --guidance G` draws, picture for picture), paired with the evaluated model at the same
    prompts and seeds: a CFG-free model against a guided base in one command."""
    import shutil

    from omniroll.models.shapes import checkpoint_dir

    other = tmp_path / "other"  # the shipped weights, sampling 4 steps by default instead of 10
    shutil.copytree(checkpoint_dir(), other)
    defaults = json.loads((other / "omniroll_defaults.json").read_text())
    defaults["pipeline"]["num_inference_steps"] = 4
    (other / "omniroll_defaults.json").write_text(json.dumps(defaults))

    ev, out = _eval(tmp_path, "paired", "--guidance", "1", "--baseline-model", str(other),
                    "--baseline-guidance", "4.5")
    line = json.loads([x for x in capsys.readouterr().out.splitlines() if x.startswith("{")][-1])
    with open(out / "baseline.json") as f:
        base = json.load(f)
    alone, _ = _eval(tmp_path, "alone", "--model", str(other), "--guidance", "4.5")

    assert ev["guidance_scale"] == 1.0 and ev["sampling"]["num_inference_steps"] == 10
    assert base["guidance_scale"] == 4.5 and base["sampling"]["num_inference_steps"] == 4
    assert ev["baseline"]["model"] == str(other) and ev["baseline"]["guidance_scale"] == 4.5
    assert base["pictures"] == alone["pictures"]  # the baseline is exactly what that model draws at that guidance
    assert ev["paired"] == paired(base["pictures"], ev["pictures"])
    assert line["baseline_guidance_scale"] == 4.5 and line["paired"] == ev["paired"]["overall"]


def test_bad_baseline_flags_fail_in_one_line_naming_the_flag_before_any_model_loads(tmp_path, capsys):
    from omniroll.cli import main

    assert main(["eval", "--model", "shapes", "--baseline-guidance", "200", "--out", str(tmp_path)]) == 2
    assert "--baseline-guidance must be in [0, 100], got 200" in capsys.readouterr().err
    assert main(["eval", "--model", "shapes", "--baseline-model", str(tmp_path / "nope"), "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--baseline-model:" in err and "nope" in err and "--model (engine.model)" not in err
    assert not os.listdir(tmp_path)
