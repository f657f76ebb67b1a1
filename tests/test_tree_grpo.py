"""`trainer.algorithm: tree_grpo` (omniroll/train/algorithms/tree_grpo.py): its per-step advantages on hand-built
trees with known rewards, the steps it trains (pruning included), the update loop taking [B, W] advantages, and the
configs it refuses at load. Its end-to-end run on the tiny model is in tests/test_algorithms_train.py."""

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from omniroll.agent_loop.batch import DataBatch
from omniroll.config import ConfigError, load_config
from omniroll.train.algorithms import TreeGRPO
from omniroll.train.algorithms.tree_grpo import tree_trained_steps

PATHS = [(0, 0), (0, 1), (1, 0), (1, 1)]
TREE = {"fork_steps": [1, 2], "widths": [2, 2]}
WINDOW = {"noise_level": 0.8, "sde_type": "sde", "sde_window_size": 4, "sde_window_range": [0, 4]}


def cfg(trainer=None, algo=None, **top):
    return load_config({"n": 4, "engine": {"model": "shapes"}, "reward": {"functions": {"g": {"fn": "shapes"}}},
                        "algo": {**WINDOW, "tree": TREE} if algo is None else algo, **top,
                        "trainer": {"algorithm": "tree_grpo", "prompts": ["a red circle"], "prompts_per_step": 1,
                                    **(trainer or {})}})


def rollout_batch(groups, paths, step_indices):
    B = len(groups)
    td = TensorDict({"step_indices": torch.as_tensor(step_indices).expand(B, -1).clone()}, batch_size=[B])
    return DataBatch(td, {"uid": np.array(groups, dtype=object), "tree_path": [list(p) for p in paths]})


def test_per_step_advantages_of_two_hand_built_trees():
    # tree a: leaves 1, 0, 0, 0 -> V(root) 0.25, V(0) 0.5, V(1) 0; leaves against their parents +0.5, -0.5, 0, 0.
    # tree b: leaves 1, 1, 1, 1 -> no credit anywhere. Forks at steps 1 and 2 of the window's steps 0-3.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = ["a"] * 4 + ["b"] * 4
    algo = TreeGRPO(cfg(), adapter=None)
    adv = algo.advantages(rewards, groups, rollout_batch(groups, PATHS * 2, [0, 1, 2, 3]))
    eps = 1e-4
    d0 = 0.25 / (math.sqrt(0.25**2 * 2 / 4) + eps)  # depth-0 nodes over both trees: +.25, -.25, 0, 0
    d1 = 0.5 / (math.sqrt(0.5**2 * 2 / 8) + eps)  # depth-1 nodes (the leaves): +.5, -.5 and six 0
    expected = torch.tensor([[0, d0, d1, d1], [0, d0, -d1, -d1], [0, -d0, 0, 0], [0, -d0, 0, 0]] + [[0, 0, 0, 0]] * 4)
    assert adv.advantages.shape == (8, 4)
    assert torch.allclose(adv.advantages, expected.float(), atol=1e-6)
    assert (adv.tied_groups, adv.num_groups, adv.tied_rewards) == (1, 2, [1.0])
    assert adv.metrics["tree/depth_0_adv_abs_mean"] == pytest.approx(d0 / 2, rel=1e-6)
    assert "tree/rerun_leaves" not in adv.metrics  # a batch without the agent loop's tree_rerun column
    batch = rollout_batch(groups, PATHS * 2, [0, 1, 2, 3])
    batch.non_tensor_batch["tree_rerun"] = np.array([False] * 4 + [True] * 4, dtype=object)  # tree b ran again
    assert algo.advantages(rewards, groups, batch).metrics["tree/rerun_leaves"] == 4


def test_advantages_follow_each_row_through_a_shuffled_batch_and_clip():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups, paths = ["a"] * 4 + ["b"] * 4, PATHS * 2
    algo = TreeGRPO(cfg({"adv_clip_max": 1.0}), adapter=None)
    perm = [6, 2, 0, 7, 3, 5, 1, 4]
    adv = algo.advantages(rewards[perm], [groups[i] for i in perm], rollout_batch(
        [groups[i] for i in perm], [paths[i] for i in perm], [0, 1, 2, 3])).advantages
    assert adv[perm.index(0)].tolist() == [0.0, 1.0, 1.0, 1.0]  # clipped at adv_clip_max
    assert adv[perm.index(1)].tolist() == [0.0, 1.0, -1.0, -1.0]
    assert torch.equal(adv[[perm.index(i) for i in range(4, 8)]], torch.zeros(4, 4))


def test_advantages_need_the_tree_columns():
    algo = TreeGRPO(cfg(), adapter=None)
    with pytest.raises(ValueError, match="tree_path and step_indices"):
        algo.advantages(torch.ones(4), ["a"] * 4)
    batch = rollout_batch(["a"] * 4, PATHS, [0, 1, 2, 3])
    del batch.non_tensor_batch["tree_path"]
    with pytest.raises(ValueError, match="tree_path and step_indices"):
        algo.advantages(torch.ones(4), ["a"] * 4, batch)


def test_trained_steps_skip_the_shared_prefix_and_prune_to_the_forks():
    steps = torch.tensor([[0, 1, 2, 3, 4]] * 3)  # window steps 0-4, forks at steps 1 and 3
    assert tree_trained_steps(steps, (1, 3), "all").tolist() == [[1, 2, 3, 4]] * 3
    assert tree_trained_steps(steps, (1, 3), "forks").tolist() == [[1, 3]] * 3
    shifted = torch.tensor([[2, 3, 4], [3, 4, 5]])  # windows that differ: positions, not step numbers
    assert tree_trained_steps(shifted, (3, 4), "forks").tolist() == [[1, 2], [0, 1]]
    with pytest.raises(ValueError, match=r"trained_steps all: the rows' SDE windows give them \[2, 3\] trained"):
        tree_trained_steps(shifted, (3, 4), "all")


def test_the_update_loop_takes_step_level_advantages_and_refuses_other_shapes():
    from omniroll.train.update import train_on_batch

    class Rows:
        def __len__(self):
            return 2

    for bad in (torch.zeros(3), torch.zeros(2, 3, 1), torch.zeros(3, 2)):
        with pytest.raises(ValueError, match=r"advantages must be \[2\] or \[2, window steps\]"):
            train_on_batch(None, None, None, Rows(), bad, None, None, num_inner_epochs=1, max_grad_norm=1.0)


def test_configs_tree_grpo_refuses_at_load():
    assert cfg().trainer.options().trained_steps == "all"
    assert cfg({"algorithm_options": {"trained_steps": "forks"}}).trainer.options().trained_steps == "forks"
    # a random window (drawn in [0, 5), 4 steps) is fine when only the forks train: every window holds them
    moving = {**WINDOW, "sde_window_range": [0, 5], "tree": TREE}
    assert cfg({"algorithm_options": {"trained_steps": "forks"}}, moving).algo.sde_window_range == (0, 5)
    bad = [({}, WINDOW, {}, "algo.tree: trainer.algorithm tree_grpo trains the step-level advantages"),
           ({}, moving, {}, r"algo.sde_window_range: trainer.algorithm tree_grpo with trained_steps all"),
           ({}, None, {"reward": {"functions": {"g": {"fn": "shapes"}, "s": {"fn": "shapes_strict"}},
                                  "aggregation": "gdpo"}}, "reward.aggregation: trainer.algorithm tree_grpo"),
           ({"algorithm_options": {"trained_steps": "some"}}, None, {}, "algorithm_options.trained_steps"),
           ({"global_std": True}, None, {},
            r"trainer.global_std does not apply to trainer.algorithm tree_grpo \(it does not read it\)"),
           ({}, {**WINDOW, "sde_type": "ode", "tree": TREE}, {}, "algo.sde_type: trainer.algorithm tree_grpo")]
    for trainer, algo, top, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            cfg(trainer, algo, **top)



def test_asynchronous_tree_grpo_trains_only_the_fork_steps_exactly(ray_cluster, tiny_sd3_path, tmp_path):
    """trained_steps forks with one fork at step 1 of the window's steps 0-2: one loss term per row (window step 1,
    its leaf's own advantage), asynchronous (max_staleness 1): finite, the weights move, every ratio exactly 1.0
    before the first update."""
    import asyncio

    from omniroll.train import Trainer
    from tests.test_algorithms_train import SDE, config

    base = config(tiny_sd3_path, "flow_grpo").model_dump(mode="json")
    base["algo"] = {**SDE, "sde_window_size": 3, "tree": {"fork_steps": [1], "widths": [4]}}
    base["trainer"].update(algorithm="tree_grpo", algorithm_options={"trained_steps": "forks"}, max_staleness=1,
                           checkpoint_every=0)
    cfg = load_config(base)
    with Trainer(cfg, str(tmp_path / "run"), log=lambda s: None) as tr:
        hist = tr.train()
        batch = asyncio.run(tr._rollout(4))
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in hist)
    assert max(m["staleness_max"] for m in hist) >= 1  # rows of a later step were sampled by older weights
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0] * 3
    rows = tr.algorithm.rows(batch, tr.policy.adapter)
    assert tr.algorithm.train_steps(rows, None).tolist() == [[1]] * len(rows)  # the fork step only
    adv = tr.algorithm.advantages(batch.batch["rm_scores"][:, 0].float(), list(batch.non_tensor_batch["uid"]), batch)
    assert torch.equal(adv.advantages[:, 0], torch.zeros(len(rows)))  # step 0, before the fork: the root's, 0
    assert torch.equal(adv.advantages[:, 1], adv.advantages[:, 2])  # one segment: the leaf's own advantage


def test_a_forward_process_algorithm_fed_by_a_tree_samples_its_window_and_trains(ray_cluster, tiny_sd3_path,
                                                                                   tmp_path):
    """AWM on a tree rollout (its group a tree forking at steps 1 and 2, a 3-step SDE window): its rollout keeps the
    window where the leaves draw their noise (not the ODE it samples otherwise), each row names its leaf, a group's
    leaves differ, and it trains (a finite loss, a gradient). Without a tree or a shared initial noise the window
    keys are refused as before; with one, the ODE is (its members could not differ)."""
    import asyncio

    from omniroll.train import Trainer
    from tests.test_algorithms_train import SDE, config

    base = config(tiny_sd3_path, "awm").model_dump(mode="json")
    base["algo"] = {**SDE, "sde_window_size": 3, "tree": {"fork_steps": [1, 2], "widths": [2, 2]}}
    base["trainer"].update(steps=1, checkpoint_every=0)
    with Trainer(load_config(base), str(tmp_path / "run"), log=lambda s: None) as tr:
        hist = tr.train()
        batch = asyncio.run(tr._rollout(2))
    assert set(batch.non_tensor_batch["sde_type"]) == {"sde"} and batch.batch["all_latents"].shape[1] == 0
    uids, paths = list(batch.non_tensor_batch["uid"]), [tuple(p) for p in batch.non_tensor_batch["tree_path"]]
    for u in set(uids):
        rows = [i for i, x in enumerate(uids) if x == u]
        assert sorted(paths[i] for i in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        finals = {tuple(batch.batch["latents"][i].flatten()[:8].tolist()) for i in rows}
        assert len(finals) == 4  # every leaf its own noise
    assert math.isfinite(hist[0]["loss"]) and hist[0]["grad_norm"] > 0
    for algo, msg in (({**SDE}, "algo.noise_level does not apply to trainer.algorithm awm"),
                      ({"same_latent": True, "noise_level": 0.0}, "algo.noise_level: trainer.algorithm awm on a group "
                                                                  "that shares its noise")):
        with pytest.raises(ConfigError, match=msg):
            load_config({**base, "algo": algo})
    assert load_config({**base, "algo": {**SDE, "same_latent": True}}).algo.same_latent  # TempFlow's fork at step 0
