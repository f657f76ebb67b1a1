"""Flow-GRPO on the shapes world end to end: the shipped model, the shapes reward, the trainer's task evaluation
before and after, and `omniroll eval` on the trainer's checkpoint drawing the very pictures (and so the very table)
the trainer's evaluation drew with those weights."""

import json
import os

from omniroll.config import load_config


def shapes_config(prompts_file, **trainer):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": "shapes", "max_batch_size": 32, "num_threads": 1},
        "pipeline": {"num_inference_steps": 6},
        "algo": {"noise_level": 0.8, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 4]},
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
    from omniroll.train import FlowGRPOTrainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a circle\nthree squares\na red circle\na circle left of a square\n")
    cfg = shapes_config(prompts)
    out = str(tmp_path / "run")
    lines = []
    with FlowGRPOTrainer(cfg, out, log=lines.append) as tr:
        hist = tr.train()
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0, 0.0]
    steps = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' not in x]
    assert all("reward/geneval/strict" in m and "reward/strict/mean" in m for m in steps)  # the zero-weight pass too
    evals = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' in x]
    assert [(e["eval"], e["step"]) for e in evals] == [("before", 0), ("after", 2)]
    assert {"eval/prompts/strict", "eval/prompts/counting/strict", "eval/prompts/chance",
            "eval/prompts/varied_prompts"} <= set(evals[-1])
    assert sum(line.startswith("eval before (step 0) prompts: strict") for line in lines) == 1
    for f in ("eval_curve.png", "eval/after_prompts_grid.png", "eval/before_prompts.json", "val_after.png",
              "eval/before_after_prompts.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    trainer_after = json.loads(open(os.path.join(out, "eval", "after_prompts.json")).read())

    capsys.readouterr()
    assert main(["eval", "--model", "shapes", "--checkpoint", out, "--prompts", str(prompts), "--seeds", "2",
                 "--steps", "6", "--out", str(tmp_path / "ev"), "--quiet"]) == 0
    mine = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert mine["pictures"] == trainer_after["pictures"]  # same seeds, same weights: the same pictures and results
    assert mine["overall"] == trainer_after["overall"]
