"""benchmarks/reward_hacking.py's own parts, without a training: each control is one trainer option on the same run
(the proxy trained, the judges at weight 0), a kept run is reused only with the same settings, and the curves and the
extra objects come out of a run's files as written (hand-made files with known numbers)."""

import argparse
import json
import os

import pytest

from benchmark_script import benchmark_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def script():
    with benchmark_script("reward_hacking") as mod:
        yield mod


def args(**kw):
    base = {"config": os.path.join(ROOT, "examples", "shapes_demo.yaml"), "steps": 0, "kl_beta": 0.003,
            "data_weight": 0.1, "eval_seeds": 0, "val_every": 0, "val_pictures": 2}
    return argparse.Namespace(**{**base, **kw})


def test_every_control_trains_the_proxy_judges_at_weight_0_and_loads(script, monkeypatch):
    from omniroll.config import load_config

    monkeypatch.chdir(ROOT)  # the config's prompt files are relative to the repository root
    trained = {}
    for control in script.CONTROLS:
        raw = script.run_config(args().config, control, 1, args(val_every=6))
        fns = raw["reward"]["functions"]
        assert fns["proxy"] == {"fn": "shapes_proxy"} and all(fns[k]["weight"] == 0.0 for k in fns if k != "proxy")
        assert raw["reward"]["held_out"] == {"judge": {"fn": "shapes_strict"}}
        assert raw["seed"] == raw["trainer"]["seed"] == 1 and raw["trainer"]["val_every"] == 6
        assert len(raw["trainer"]["val_prompts"]) == 37 and raw["val_kwargs"]["n"] == 2
        tc = load_config(raw).trainer
        trained[control] = (tc.kl_beta, tc.kl_reference, tc.kl_gate is not None, tc.diversity_bonus,
                            tc.data_regularizer is not None)
    assert trained == {"none": (0.0, "base", False, False, False), "kl_base": (0.003, "base", False, False, False),
                       "kl_ema": (0.003, "ema", False, False, False), "gardo": (0.003, "reset", True, True, False),
                       "data": (0.0, "base", False, False, True)}


def test_a_kept_run_is_read_back_only_with_the_same_settings(script, tmp_path, monkeypatch):
    out = tmp_path / "none-0"
    out.mkdir()
    settings = script.run_settings("none", 0, args())
    (out / "result.json").write_text(json.dumps({"settings": settings, "result": {"kept": True}}))
    assert script.kept_run("none", 0, args(), str(out)) == {"kept": True}
    ran = []
    monkeypatch.setattr(script, "run", lambda control, seed, a, d: ran.append(a.kl_beta) or {"kept": False})
    assert script.kept_run("none", 0, args(kl_beta=0.1), str(out)) == {"kept": False} and ran == [0.1]
    assert json.loads((out / "result.json").read_text())["settings"]["kl_beta"] == 0.1  # replaced


def test_the_curves_and_the_extra_objects_come_from_the_runs_files(script, tmp_path):
    rows = [{"step": 0, "tag": "before", "held_out/rows": {"trained": [0.2, 0.4, 0.3], "judge": [0, 1, 0]}},
            {"step": 6, "tag": "step", "held_out/rows": {"trained": [0.5, 0.6, 0.5], "judge": [0, 1, None]}}]
    (tmp_path / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = script.validation_curve(str(tmp_path))
    assert [p["step"] for p in curve] == [0, 6] and curve[1]["proxy"] == pytest.approx(1.6 / 3)
    assert curve[1]["judge"] == 0.5 and curve[1]["judge_z"] == 0.0  # the None picture left out of both sides
    assert curve[1]["proxy_z"] == pytest.approx(7.0)  # differences 0.3, 0.2, 0.2: mean 0.7 / 3, its se 1 / 30
    pictures = [{"prompt": "two circles", "seed": s, "tag": "counting", "strict": True, "partial": 1.0,
                 "chance": False, "reasons": [], "extra": False} for s in range(4)]
    too_many, too_few = ["expected circle<3, found 3"], ["expected circle>=2, found 1"]
    after = [dict(p, strict=s > 1, extra=s < 2, reasons=[too_many, too_few][s] if s < 2 else [])
             for s, p in enumerate(pictures)]
    os.mkdir(tmp_path / "eval")
    for name, pics in (("before_x.json", pictures), ("after_x.json", after)):
        (tmp_path / "eval" / name).write_text(json.dumps({"split": "x.txt", "guidance_scale": 1.0, "pictures": pics}))
    e = script.run_evaluations(str(tmp_path))["x"]
    assert script.extra_objects(e) == {"extra_before": 0.0, "extra_after": 0.5, "extra_failures_before": 0,
                                       "extra_failures_after": 1, "extra_failures_z": 1.0}
    assert e["paired"]["overall"]["down"] == 2 and e["paired"]["overall"]["up"] == 0
    for p in pictures:
        del p["extra"]  # an evaluation written before the checker said so: nothing claimed
    (tmp_path / "eval" / "before_x.json").write_text(json.dumps({"split": "x.txt", "guidance_scale": 1.0,
                                                                 "pictures": pictures}))
    assert "extra_before" not in script.extra_objects(script.run_evaluations(str(tmp_path))["x"])


def test_each_control_is_paired_with_the_uncontrolled_run_of_its_seed(script, tmp_path):
    too_many, too_few = "expected circle<3, found 3", "expected circle>=2, found 1"

    def kept(name, verdicts, settings):  # verdicts after training: "pass", "extra" or "few", one per seed
        run = tmp_path / name
        os.makedirs(run / "eval")
        pictures = [{"prompt": "two circles", "seed": s, "tag": "counting", "strict": v == "pass", "partial": 1.0,
                     "chance": False, "reasons": {"pass": [], "extra": [too_many], "few": [too_few]}[v]}
                    for s, v in enumerate(verdicts)]
        for when in ("before", "after"):
            (run / "eval" / f"{when}_x.json").write_text(json.dumps({"split": "x.txt", "guidance_scale": 1.0,
                                                                     "pictures": pictures}))
        (run / "result.json").write_text(json.dumps({"settings": settings, "result": {}}))
        return str(run)

    a = args()
    none = kept("none-0", ["extra", "extra", "extra", "pass", "few"], script.run_settings("none", 0, a))
    data = kept("data-0", ["pass", "pass", "few", "extra", "few"], script.run_settings("data", 0, a))
    assert script.none_run(str(tmp_path), 0, args(kl_beta=1.0)) == none  # the KL weight does not touch `none`
    assert script.against_none(none, data) == {"x": {"up": 2, "down": 1, "z": pytest.approx(1 / 3 ** 0.5),
                                                     "extra_failures_none": 3, "extra_failures": 1,
                                                     "extra_failures_z": pytest.approx(-1.0)}}
    assert script.none_run(str(tmp_path), 0, args(steps=96)) is None  # another budget: not paired
    assert script.none_run(str(tmp_path), 1, a) is None  # no run of that seed
    other = kept("none-1", ["pass"], script.run_settings("none", 1, a))
    with pytest.raises(ValueError, match="same prompts and seeds"):
        script.against_none(other, data)
