"""Training on the shapes world end to end: the shipped model, the shapes reward, the trainer's task evaluation before
and after (at the guidance scales of the regime the algorithm trains, the after one paired with the before one), and
`omniroll eval` on the trainer's checkpoint drawing the very pictures (and so the very table and the very paired
comparison, with `--baseline none`) the trainer's evaluation drew with those weights."""

import json
import os

from omniroll.config import load_config


SDE = {"noise_level": 0.8, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 4]}


def shapes_config(prompts_file, algo=SDE, merge_lora=False, **trainer):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": "shapes", "max_batch_size": 32, "num_threads": 1, "merge_lora": merge_lora},
        "pipeline": {"num_inference_steps": 6},
        "algo": algo,
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {"geneval": {"fn": "shapes"},
                                                   "strict": {"fn": "shapes_strict", "weight": 0.0}}},
        "n": 4, "prompt_length": 12, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"prompts_file": str(prompts_file), "prompts_per_step": 2, "lr": 0.003, "micro_batch_size": 8,
                    "steps": 2, "num_threads": 1, "evaluation": {"splits": [str(prompts_file)], "seeds": 2},
                    **trainer},
    })


def test_training_evaluates_both_ends_and_omniroll_eval_reproduces_the_last(ray_cluster, tmp_path, capsys):
    from omniroll.cli import main
    from omniroll.train import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a circle\nthree squares\na red circle\na circle left of a square\n")
    cfg = shapes_config(prompts)
    out = str(tmp_path / "run")
    lines = []
    with Trainer(cfg, out, log=lines.append) as tr:
        hist = tr.train()
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0, 0.0]
    steps = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' not in x]
    assert all("reward/geneval/strict" in m and "reward/strict/mean" in m for m in steps)  # the zero-weight pass too
    evals = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' in x]
    assert [(e["eval"], e["step"]) for e in evals] == [("before", 0), ("after", 2)]
    name = "prompts_cfg4.5"  # Flow-GRPO samples with the pipeline's CFG: evaluated there
    assert {f"eval/{name}/strict", f"eval/{name}/se", f"eval/{name}/counting/strict", f"eval/{name}/chance",
            f"eval/{name}/varied_prompts"} <= set(evals[-1])
    assert {f"eval/{name}/paired_up", f"eval/{name}/paired_z", f"eval/{name}/counting/paired_down"} <= set(evals[-1])
    assert not any("paired" in k for k in evals[0])
    assert sum(line.startswith(f"eval before (step 0) {name} (CFG 4.5): strict") for line in lines) == 1
    assert sum(line.startswith("  vs before: ") for line in lines) == 1
    for f in ("eval_curve.png", f"eval/after_{name}_grid.png", f"eval/before_{name}.json", "val_after.png",
              f"eval/before_after_{name}.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    trainer_after = json.loads(open(os.path.join(out, "eval", f"after_{name}.json")).read())
    assert trainer_after["guidance_scale"] == 4.5
    # the validation grid draws where it trains too: Flow-GRPO's rollout keeps the pipeline's CFG
    assert [ln.split(":")[0] for ln in lines if ln.startswith("validation ")] == [
        "validation before (CFG 4.5)", "validation after (CFG 4.5)"]
    assert [v["cfg_scale"] for v in map(json.loads, open(os.path.join(out, "validation.jsonl")))] == [4.5, 4.5]

    capsys.readouterr()
    assert main(["eval", "--model", "shapes", "--checkpoint", out, "--baseline", "none", "--prompts", str(prompts),
                 "--seeds", "2", "--steps", "6", "--out", str(tmp_path / "ev"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    mine = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert mine["pictures"] == trainer_after["pictures"]  # same seeds, same weights: the same pictures and results
    assert mine["overall"] == trainer_after["overall"]
    # the baseline `none` is the model itself, which the trainer's "before" evaluation drew: the same comparison
    assert [mine["paired"]["overall"][k] for k in ("up", "down", "z")] == [
        evals[-1][f"eval/{name}/paired_{k}"] for k in ("up", "down", "z")]
    assert "McNemar z" in printed and "guidance 4.5" in printed
    assert (tmp_path / "ev" / "baseline.json").is_file() and (tmp_path / "ev" / "baseline_grid.png").is_file()


def test_a_cfg_free_algorithm_is_evaluated_cfg_free_first_with_the_guided_numbers_beside(ray_cluster, tmp_path, capsys):
    from omniroll.cli import main
    from omniroll.train import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a circle\nthree squares\n")
    cfg = shapes_config(prompts, algo={}, algorithm="nft", steps=1, algorithm_options={"timestep_fraction": 0.3},
                        evaluation={"splits": [str(prompts)], "seeds": 1}, merge_lora=True)
    assert cfg.evaluation_guidances() == [1.0, 4.5]
    out = str(tmp_path / "run")
    lines, drawn = [], []
    with Trainer(cfg, out, log=lines.append) as tr:
        log_validation = tr.tracker.log_validation  # records the scale every validation picture was drawn at

        def recording(tag, step, batch, *args, **kwargs):
            drawn.append((tag, sorted(set(batch.batch["guidance_scale"].tolist()))))
            return log_validation(tag, step, batch, *args, **kwargs)

        tr.tracker.log_validation = recording
        tr.train()
    # the validation grid (val_before / val_after.png, the validation curve) is drawn CFG-free too: the regime NFT
    # trains, as the evaluation's first scale, not the pipeline's CFG 4.5
    assert drawn == [("before", [1.0]), ("after", [1.0])]
    assert [ln.split(":")[0] for ln in lines if ln.startswith("validation ")] == [
        "validation before (CFG off)", "validation after (CFG off)"]
    assert [v["cfg_scale"] for v in map(json.loads, open(os.path.join(out, "validation.jsonl")))] == [1.0, 1.0]
    after = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' in x][-1]
    assert {"eval/prompts_cfg1/strict", "eval/prompts_cfg4.5/strict", "eval/prompts_cfg1/paired_z",
            "eval/prompts_cfg1/vs_guided_before_z"} <= set(after)  # CFG off now against the guided model before
    assert sum("prompts_cfg1 (CFG off) vs prompts_cfg4.5 before training (CFG 4.5)" in ln for ln in lines) == 1
    assert [ln.split(":")[0] for ln in lines if ln.startswith("eval after")] == [
        "eval after (step 1) prompts_cfg1 (CFG off)", "eval after (step 1) prompts_cfg4.5 (CFG 4.5)"]
    capsys.readouterr()
    assert main(["eval", "--model", "shapes", "--checkpoint", out, "--prompts", str(prompts), "--seeds", "1",
                 "--steps", "6", "--out", str(tmp_path / "ev"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "guidance 1 (CFG off): the regime" in printed  # the checkpoint's own regime by default
    assert "the LoRA merged into the weights: as " in printed  # and merged, as its run drew (engine.merge_lora)
    trainer_after = json.loads(open(os.path.join(out, "eval", "after_prompts_cfg1.json")).read())
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["pictures"] == trainer_after["pictures"]


def test_the_validation_draws_in_the_regime_the_algorithm_trains_unless_val_kwargs_sets_the_scale(tmp_path):
    """`validation_guidance`: CFG off for a CFG-free rollout (NFT, AWM), the pipeline's CFG for Flow-GRPO or for NFT
    with `rollout_cfg`, and always the scale `val_kwargs.pipeline.guidance_scale` sets."""
    from types import SimpleNamespace

    from omniroll.train.algorithms import make_algorithm
    from omniroll.train.report.validation import validation_guidance

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a circle\nthree squares\n")
    shapes = SimpleNamespace(guidance_kind="cfg")  # the shapes adapter's guidance: classifier-free

    def guidance(algo=SDE, val=None, **trainer):
        cfg = shapes_config(prompts, algo=algo, **trainer)
        if val is not None:
            cfg = load_config(cfg, overrides=[f"val_kwargs.pipeline.guidance_scale={val}"])
        return validation_guidance(cfg, make_algorithm(cfg, shapes))

    assert guidance() == ({}, 4.5)
    assert guidance(algo={}, algorithm="nft") == ({"guidance_scale": 1.0}, 1.0)
    assert guidance(algo={}, algorithm="awm") == ({"guidance_scale": 1.0}, 1.0)
    assert guidance(algo={}, algorithm="nft", algorithm_options={"rollout_cfg": True}) == ({}, 4.5)
    assert guidance(algo={}, algorithm="nft", val=3.0) == ({}, 3.0)
    assert guidance(val=2.0) == ({}, 2.0)
