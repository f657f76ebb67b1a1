"""GARDO's diversity-aware advantages (`trainer.diversity_bonus`, omniroll/train/diversity.py): the distance to a
group's nearest other sample, the weights it gives, the bonus only on advantages above the group's mean, and a run
that logs the mode-collapse meter."""

import numpy as np
import pytest
import torch

from omniroll.train.diversity import diversity_weights, nearest_distances, pixel_features, with_diversity_bonus


def test_the_nearest_neighbour_distance_is_within_the_group_and_twins_are_at_zero():
    f = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    groups = ["a", "a", "a", "b", "b", "c"]
    d = nearest_distances(f, groups)
    assert d.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # c is alone: 0
    w = diversity_weights(d, groups)
    assert w.tolist() == pytest.approx([0.0, 0.0, 3.0, 1.0, 1.0, 1.0])  # a's mean distance 1/3; b's 1; c's 0: kept


def test_only_an_advantage_above_the_groups_mean_is_scaled_and_the_clip_holds():
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    w = torch.tensor([0.0, 3.0, 3.0, 0.5], dtype=torch.float64)
    assert with_diversity_bonus(adv, w, 5.0).tolist() == pytest.approx([0.0, -1.0, 5.0, -0.5])  # 6 clipped to 5
    steps = torch.tensor([[1.0, -2.0], [0.5, 0.5]])  # [B, W]: a step-level algorithm's
    assert with_diversity_bonus(steps, torch.tensor([2.0, 0.0]), 5.0).tolist() == [[2.0, -2.0], [0.0, 0.0]]


def test_pixel_features_compare_what_differs_from_the_batchs_mean_sample():
    from omniroll.tasks.shapes.render import render_prompt

    pics = [render_prompt("a red circle", s) for s in (1, 2)] + [render_prompt("a blue square", 3)]
    x = torch.from_numpy(np.stack(pics)).permute(0, 3, 1, 2).float() / 255
    f = pixel_features(x)
    assert f.shape == (3, 3 * 64) and torch.allclose(f.norm(dim=1), torch.ones(3, dtype=torch.float64))
    raw = torch.nn.functional.normalize(x.reshape(3, -1).double(), dim=1)
    assert float(raw[0] @ raw[2]) > 0.9  # raw pixels: the shared background makes every pair look alike
    assert float(f[0] @ f[2]) < 0.5
    clips = x[:, None].expand(3, 4, 3, 64, 64)
    assert pixel_features(clips).shape == (3, 4 * 3 * 64)
    with pytest.raises(ValueError, match="diversity: samples must be"):
        pixel_features(x[0])


@pytest.mark.slow  # slow: trains on Ray
def test_a_run_with_the_bonus_logs_the_diversity_meter(ray_cluster, tiny_sd3_path, tmp_path):
    from test_train import train_config

    from omniroll.train import Trainer

    with Trainer(train_config(tiny_sd3_path, steps=2, diversity_bonus=True), str(tmp_path / "run"),
                 log=lambda s: None) as tr:
        hist = tr.train()
    assert all(0 < m["diversity_distance"] <= 2 for m in hist), [m["diversity_distance"] for m in hist]
