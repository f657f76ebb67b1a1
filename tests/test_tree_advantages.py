"""Step-level advantages of a tree rollout (omniroll/train/tree_advantages.py) on hand-built trees with known
rewards."""

import math

import pytest
import torch

from omniroll.train.tree_advantages import node_advantages, tree_step_advantages

PATHS = [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_two_level_tree_by_hand():
    # root mean 1; child 0 mean 2 (+1), child 1 mean 0 (-1); leaves against their parents: -1, +1, 0, 0
    adv = node_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0]), ["u"] * 4, PATHS, eps=0.0)
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, 1.0, -1.0, -1.0]))  # depth 0: std of {+1, -1} is 1
    s = math.sqrt(0.5)  # depth 1: std of {-1, +1, 0, 0}
    assert torch.allclose(adv[:, 1], torch.tensor([-1 / s, 1 / s, 0.0, 0.0]))
    steps = torch.arange(6).expand(4, 6)  # forks at steps 2 and 4: steps 0-1 are the root's, 2-3 depth 0, 4-5 depth 1
    per_step = tree_step_advantages(adv, (2, 4), steps)
    assert torch.equal(per_step[:, :2], torch.zeros(4, 2))
    assert torch.equal(per_step[:, 2:4], adv[:, :1].expand(4, 2))
    assert torch.equal(per_step[:, 4:], adv[:, 1:].expand(4, 2))


def test_nodes_are_normalised_per_depth_over_the_batch_and_trees_stay_apart():
    # tree a as above; tree b: every leaf 5 (no credit anywhere); tree c: the same differences doubled
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 5, 5, 5, 5, 2.0, 6.0, 0.0, 0.0])
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    adv = node_advantages(rewards, groups, PATHS * 3, eps=0.0)
    assert torch.equal(adv[4:8], torch.zeros(4, 2))
    assert torch.allclose(adv[8:], 2 * adv[:4])
    # depth 0 nodes over the batch: +1, -1, 0, 0, +2, -2 -> population std sqrt(10 / 6)
    assert torch.allclose(adv[0, 0], torch.tensor(1 / math.sqrt(10 / 6)), atol=1e-6)
    # a tree's rows need not be contiguous or ordered
    perm = [5, 0, 9, 3, 11, 1, 6, 2, 8, 4, 10, 7]
    adv_p = node_advantages(rewards[perm], [groups[i] for i in perm], [(PATHS * 3)[i] for i in perm], eps=0.0)
    assert torch.allclose(adv_p, adv[perm])


def test_a_three_level_tree_and_an_unequal_split():
    paths = [(a, b, c) for a in range(2) for b in range(2) for c in range(2)]
    rewards = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 8])  # only leaf (1, 1, 1) scores
    adv = node_advantages(rewards, ["u"] * 8, paths, adv_clip_max=100.0)
    assert (adv[7] > 0).all() and (adv[:4, 0] < 0).all() and (adv[4:, 0] > 0).all()
    assert adv[6, 2] < 0 and adv[4, 1] < 0 and adv[4, 2] == 0  # (1, 0, *): its subtree scored nothing
    steps = torch.tensor([[1, 3, 5, 7]] * 8)  # forks at 2, 4, 6: each recorded step in its own segment
    per = tree_step_advantages(adv, (2, 4, 6), steps)
    assert torch.equal(per[:, 0], torch.zeros(8)) and torch.equal(per[:, 1:], adv)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="one entry per reward"):
        node_advantages(torch.zeros(4), ["u"] * 3, PATHS)
    with pytest.raises(ValueError, match="NaN"):
        node_advantages(torch.tensor([0.0, float("nan"), 0, 0]), ["u"] * 4, PATHS)
    with pytest.raises(ValueError, match="one entry per fork"):
        node_advantages(torch.zeros(4), ["u"] * 4, PATHS[:3] + [(1,)])
    # two trees under one uid (e.g. a batch that repeats a prompt group's uid) would be credited as one tree
    with pytest.raises(ValueError, match=r"tree_path: rows 0 and 4 of group 'u' are both leaf \[0, 0\]: a group"):
        node_advantages(torch.zeros(8), ["u"] * 8, PATHS * 2)
    assert node_advantages(torch.zeros(8), ["u"] * 4 + ["v"] * 4, PATHS * 2).shape == (8, 2)  # one tree each: fine
