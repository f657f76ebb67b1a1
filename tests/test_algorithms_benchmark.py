"""benchmarks/algorithms.py's bookkeeping, without a training: a variant (`--label`, `--override`) is kept apart from
the recipe's own runs in `--partial` records, and `--summarize` tables both under their names (hand-made records
with known numbers)."""

import json
import os

import pytest

from benchmark_script import benchmark_script


@pytest.fixture(scope="module")
def script():
    with benchmark_script("algorithms") as mod:
        yield mod


def record(script, algorithm: str, seed: int, z: float, **variant) -> dict:
    """A --partial record of a run at the recipe's steps (a record's `steps` is the steps its run took)."""
    paired = {"overall": {"up": 10, "down": 5, "n": 100, "z": z, "verdict": "no detectable change"}, "categories": {}}
    ev = {"before": {"strict": 0.5, "categories": {"counting": 0.5}}, "paired": paired,
          "after": {"strict": 0.55, "categories": {"counting": 0.6}}, "split": "s.txt", "guidance_scale": 4.5}
    return {"algorithm": algorithm, "seed": seed, "eval_seeds": None, "model": None, **variant,
            "evals": {"shapes_eval_train_cfg4.5": ev}, "train_s": 60.0, "samples": 48,
            "steps": script.recipe_steps(algorithm), "grad_cos_mean": None}


def parse(script, *argv):
    p = script.argparse.ArgumentParser()
    for name, kw in (("--steps", {"type": int}), ("--eval-seeds", {"type": int}), ("--model", {}), ("--label", {}),
                     ("--partial", {})):
        p.add_argument(name, default=None, **kw)
    p.add_argument("--override", action="append", default=[])
    return p.parse_args(list(argv))


def test_a_variants_records_are_not_the_recipes_and_the_recipes_are_not_the_variants(script, tmp_path):
    path = tmp_path / "runs.jsonl"
    mix = {"label": "mixgrpo", "overrides": ["algo.sde_window_size=2"]}
    rows = [record(script, "dance_grpo", 0, 0.5), record(script, "dance_grpo", 1, 1.5, **mix)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    plain = script.finished_runs(parse(script, "--partial", str(path), "--steps", "7"))
    assert plain == {}  # runs of other steps: nothing reused
    plain = script.finished_runs(parse(script, "--partial", str(path)))
    assert set(plain) == {("dance_grpo", 0)}
    variant = script.finished_runs(parse(script, "--partial", str(path), "--label", "mixgrpo",
                                         "--override", "algo.sde_window_size=2"))
    assert set(variant) == {("dance_grpo", 1)}
    other = script.finished_runs(parse(script, "--partial", str(path), "--label", "mixgrpo",
                                       "--override", "algo.sde_window_size=3"))
    assert other == {}  # the same label with other overrides is another variant


def test_summarize_tables_the_recipe_and_its_variant_under_their_names(script, tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    mix = {"label": "mixgrpo", "overrides": ["algo.sde_window_size=2"]}
    rows = [record(script, "dance_grpo", 0, 0.5), record(script, "dance_grpo", 0, 2.5, **mix),
            record(script, "awm", 0, 3.0)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    plot = str(tmp_path / "p.png")
    assert script.main(["--algorithms", "dance_grpo", "--summarize", str(path), "--plot", plot]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["summary"]["shapes_eval_train_cfg4.5"]["dance_grpo"]["z"] == [0.5]
    assert out["summary"]["shapes_eval_train_cfg4.5"]["mixgrpo"]["z"] == [2.5]
    assert "awm" not in out["summary"]["shapes_eval_train_cfg4.5"] and os.path.isfile(plot)
    assert script.main(["--algorithms", "dance_grpo", "--label", "mixgrpo", "--summarize", str(path),
                        "--plot", plot]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out["summary"]["shapes_eval_train_cfg4.5"]) == ["mixgrpo"]


def test_a_label_names_one_algorithm_and_an_override_needs_a_value(script):
    with pytest.raises(SystemExit):
        script.main(["--algorithms", "dance_grpo,awm", "--label", "x", "--summarize", "none"])
    with pytest.raises(SystemExit):
        script.main(["--algorithms", "dance_grpo", "--override", "algo.sde_window_size", "--summarize", "none"])
