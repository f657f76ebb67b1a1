"""What a training run reports about itself, on real runs (local Ray, the tiny SD3): every reward function's own
mean and every numeric scorer extra per step and per validation, captioned validation grids, the step line's
total."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from omniroll.config import load_config
from tests.reward_fns import colour_channels
from tests.test_train import train_config


def _jsonl(path):
    return [json.loads(x) for x in open(path)]


def test_steps_and_validations_report_every_reward_function_and_extra_and_the_grids_are_captioned(
        ray_cluster, tiny_sd3_path, tmp_path):
    """colour (weight 1) beside strict (weight 0), a scorer returning dicts (a strict pass + each channel's mean)."""
    from omniroll.reward import RewardSample
    from omniroll.train import FlowGRPOTrainer

    cfg = load_config(train_config(tiny_sd3_path, steps=5),
                      overrides=["reward.functions.strict.fn=tests.reward_fns:colour_channels",
                                 "reward.functions.strict.weight=0"])

    class Recording(FlowGRPOTrainer):  # keeps every training batch
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
    assert len(val_lines) == 2 and all("(colour " in ln and ", strict " in ln and "strict/blue " in ln
                                       for ln in val_lines), val_lines

    # the grid: 2 prompts x val_kwargs.n 2 pictures of 32 px, upscaled to 64, each over a caption band of dark text
    grid = np.asarray(Image.open(os.path.join(out, "val_before.png")).convert("L"))
    from omniroll.train.val_grid import MIN_CELL

    cell_h = grid.shape[0] // 2
    assert grid.shape[1] == 2 * MIN_CELL and cell_h > 64
    for r in range(2):
        for c in range(2):
            band = grid[r * cell_h + 64: (r + 1) * cell_h, c * MIN_CELL: (c + 1) * MIN_CELL]
            assert (band < 80).sum() > 100 and (band == 255).mean() > 0.5  # text on white
