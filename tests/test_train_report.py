"""What a training run reports about itself, on real runs (local Ray, the tiny SD3): how far each update moved the
policy (without changing the training), every reward function's own mean and every numeric scorer extra per step and
per validation, captioned validation grids, the step line's total, and a run without learning signal that stops
with its checkpoint and exit 1. The pure pieces: tests/test_policy_move.py, tests/test_signal_check.py."""

import json
import os

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from omniroll.config import load_config
from tests.reward_fns import colour_channels
from tests.test_train import lora_weights, train_config

TIMING = {"rollout_s", "reward_wait_s", "rollout_wait_s", "train_s", "sync_s", "step_s", "overlap_frac",
          "samples_per_s", "policy_move_s", "recompute_s"}
MOVE = {"policy_kl", "post_approx_kl", "post_clip_frac"}


def _jsonl(path):
    return [json.loads(x) for x in open(path)]


def test_the_policy_move_is_measured_after_the_update_and_changes_nothing_of_the_training(
        ray_cluster, tiny_sd3_path, tmp_path):
    """max_staleness 1 (the decoupled objective), LoRA, lr 0.01: 3 steps measuring the move (8 rows) and 3 with
    policy_move_rows 0 train to the same weights bitwise, with the same metrics. The move is > 0 at every step, where
    approx_kl and clip_frac, measured before the step's only update, are 0."""
    from omniroll.train import Trainer

    runs = {}
    for rows in (8, 0):
        out = str(tmp_path / f"rows{rows}")
        with Trainer(train_config(tiny_sd3_path, steps=3, max_staleness=1, policy_move_rows=rows), out,
                             log=lambda s: None) as tr:
            tr.train()
        runs[rows] = (_jsonl(os.path.join(out, "metrics.jsonl")), lora_weights(os.path.join(out, "checkpoints",
                                                                                            "step_000003")))
    (measured, w_a), (plain, w_b) = runs[8], runs[0]
    assert all(m["policy_kl"] > 0 and m["post_approx_kl"] > 0 and 0 <= m["post_clip_frac"] <= 1 for m in measured)
    assert [(m["approx_kl"], m["clip_frac"]) for m in measured] == [(0.0, 0.0)] * 3
    assert [m["staleness_max"] for m in measured] == [0, 1, 1]  # the asynchronous schedule ran
    assert not any({"policy_kl", "post_approx_kl", "post_clip_frac"} & set(m) for m in plain)
    assert [{k: v for k, v in m.items() if k not in TIMING | MOVE} for m in measured] == \
        [{k: v for k, v in m.items() if k not in TIMING | MOVE} for m in plain]
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_steps_and_validations_report_every_reward_function_and_extra_and_the_grids_are_captioned(
        ray_cluster, tiny_sd3_path, tmp_path):
    """colour (weight 1) beside strict (weight 0), a scorer returning dicts (a strict pass + each channel's mean)."""
    from omniroll.reward import RewardSample
    from omniroll.train import Trainer

    cfg = load_config(train_config(tiny_sd3_path, steps=5),
                      overrides=["reward.functions.strict.fn=tests.reward_fns:colour_channels",
                                 "reward.functions.strict.weight=0"])

    class Recording(Trainer):  # keeps every training batch
        async def _rollout(self, step):
            out = await super()._rollout(step)
            self.batches[step] = out
            return out

    out, lines = str(tmp_path / "run"), []
    with Recording(cfg, out, log=lines.append) as tr:
        tr.batches = {}
        tr.train(2)  # trainer.steps is 5
    assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == ["1/2", "2/2"]

    for m in _jsonl(os.path.join(out, "metrics.jsonl")):  # each step: the scorer's own numbers, over its rows
        batch = tr.batches[m["step"]]
        images, prompts = batch.batch["responses"].numpy(), list(batch.non_tensor_batch["raw_prompt"])
        want = colour_channels([RewardSample(sample_id=str(i), image=images[i], prompt=prompts[i])
                                for i in range(len(images))])
        assert m["reward/strict/mean"] == pytest.approx(np.mean([w["score"] for w in want]))
        for c in ("red", "green", "blue"):
            assert m[f"reward/strict/{c}"] == pytest.approx(np.mean([w[c] for w in want]))
        assert m["reward/colour/mean"] == pytest.approx(m["reward_mean"], abs=1e-6)  # weights 1 and 0
        assert not [k for k in m if k.endswith(("/attempts", "/time_s", "/error"))]

    vals = _jsonl(os.path.join(out, "validation.jsonl"))
    assert [v["tag"] for v in vals] == ["before", "after"]
    for v in vals:
        assert {"reward/colour/mean", "reward/strict/mean", "reward/strict/red", "reward/strict/green",
                "reward/strict/blue"} <= set(v) and not [k for k in v if k.endswith(("/attempts", "/time_s"))]
        assert v["reward/colour/mean"] == pytest.approx(v["val_reward_mean"], abs=1e-6)
        assert 0.0 <= v["reward/strict/mean"] <= 1.0
    val_lines = [ln for ln in lines if ln.startswith("validation ")]
    # the line names each function's mean; the per-category extras stay in validation.jsonl (checked above)
    assert len(val_lines) == 2 and all("(colour " in ln and ", strict " in ln and "strict/blue" not in ln
                                       for ln in val_lines), val_lines

    # the grid: 2 prompts x val_kwargs.n 2 pictures of 32 px, upscaled to 64, each over a caption band of dark text
    grid = np.asarray(Image.open(os.path.join(out, "val_before.png")).convert("L"))
    from omniroll.train.report.val_grid import MIN_CELL

    cell_h = grid.shape[0] // 2
    assert grid.shape[1] == 2 * MIN_CELL and cell_h > 64
    for r in range(2):
        for c in range(2):
            band = grid[r * cell_h + 64: (r + 1) * cell_h, c * MIN_CELL: (c + 1) * MIN_CELL]
            assert (band < 80).sum() > 100 and (band == 255).mean() > 0.5  # text on white


def test_a_run_without_learning_signal_stops_with_its_checkpoint_and_exits_1(ray_cluster, tiny_sd3_path, tmp_path,
                                                                              capsys):
    """The only reward function weighted 0: every reward is 0, every group tied, every update a no-op. The run warns
    once, stops after trainer.signal_check.stop_after_tied_steps = 2 steps with the checkpoint of step 2 and exits 1,
    one line per problem, no traceback; the move of a no-op update is exactly 0; the zero-weight function's own
    score is still reported."""
    from omniroll.cli import main

    cfg = load_config(train_config(tiny_sd3_path, steps=6, signal_check={"stop_after_tied_steps": 2}),
                      overrides=["reward.functions.colour.weight=0"])
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = str(tmp_path / "run")
    assert main(["train", "--config", str(cfg_file), "--out", out, "--steps", "4"]) == 1
    std = capsys.readouterr()
    err = std.err.strip().splitlines()
    assert len(err) == 4 and all(ln.startswith("omniroll train: error: ") for ln in err), std.err
    assert "Traceback" not in std.err + std.out
    assert "no learning signal" in err[0] and "for 2 consecutive steps, 1-2: tied_groups/num_groups 2/2, 2/2" in err[0]
    assert "reward mean +- std +0 +- 0, +0 +- 0" in err[0]
    assert "likely cause: a learning rate too high" in err[1] and "trainer.lr=0.01" in err[1] and "(n=4)" in err[1]
    assert "what to change: lower trainer.lr" in err[2]
    assert f"stopped after step 2; its checkpoint is in {os.path.join(out, 'checkpoints')}" in err[3]
    warnings = [ln for ln in std.out.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 1: 2/2 prompt groups have tied rewards")
    assert [ln.split()[1] for ln in std.out.splitlines() if ln.startswith("step ")] == ["1/4", "2/4"]
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == "step_000002"
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_000002", "trainer_state.pt"))

    metrics = _jsonl(os.path.join(out, "metrics.jsonl"))
    assert [(m["step"], m["tied_groups"], m["num_groups"], m["reward_std"]) for m in metrics] == [(1, 2, 2, 0.0),
                                                                                                  (2, 2, 2, 0.0)]
    assert [(m["policy_kl"], m["post_approx_kl"], m["post_clip_frac"]) for m in metrics] == [(0.0, 0.0, 0.0)] * 2
    (before,) = _jsonl(os.path.join(out, "validation.jsonl"))
    assert before["val_reward_mean"] == 0.0 and before["reward/colour/mean"] != 0.0
    assert all(m["reward/colour/mean"] != 0.0 for m in metrics)
