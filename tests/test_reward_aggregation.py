"""`reward.aggregation`: GDPO's per-function group normalisation against hand-computed numbers,
a missing component failing its sample by name, `sum` left exactly as it was, and a real training step on the tiny
model with two reward functions under `gdpo` that logs both components and the aggregated reward."""

from __future__ import annotations

import asyncio
import json
import math
import os

import numpy as np
import pytest
import torch

from omniroll.agent_loop.batch import prompt_batch
from omniroll.agent_loop.worker import AgentLoopError
from omniroll.config import ConfigError, load_config
from omniroll.reward import RewardManager, RewardSample
from omniroll.reward.aggregation import check_components, gdpo_scores, group_normalise, whiten
from omniroll.train.advantages import gdpo_advantages, group_advantages
from tests.reward_fns import make_image

FNS = "tests.reward_fns"


def test_gdpo_by_hand():
    # two groups of two; A ties in the second group, B varies in both. eps 0 for round numbers:
    # z_A = [-1, 1, 0, 0] (group 0: mean 2, population std 1; group 1 ties), z_B = [-1, 1, 1, -1]
    # s = 1 z_A + 2 z_B = [-3, 3, 2, -2]; mean 0, population std sqrt(26 / 4) -> a = s / sqrt(6.5)
    comps = {"A": [1.0, 3.0, 5.0, 5.0], "B": [0.0, 0.2, 0.4, 0.0]}
    out = gdpo_scores(comps, {"A": 1.0, "B": 2.0}, ["p", "p", "q", "q"], eps=0.0)
    np.testing.assert_allclose(out.scores, np.array([-3, 3, 2, -2]) / math.sqrt(6.5), rtol=1e-12)
    assert out.tied_groups == {"A": 1, "B": 0}
    assert out.group_std == pytest.approx({"A": 0.5, "B": 0.15})  # (1 + 0) / 2, (0.1 + 0.2) / 2
    # with the default eps (1e-4), added to each std: the same steps, numbers by hand
    z_a = np.array([-1 / 1.0001, 1 / 1.0001, 0, 0])
    z_b = np.array([-0.1 / 0.1001, 0.1 / 0.1001, 0.2 / 0.2001, -0.2 / 0.2001])
    s = z_a + 2 * z_b
    expected = (s - s.mean()) / (s.std() + 1e-4)
    np.testing.assert_allclose(gdpo_scores(comps, {"A": 1.0, "B": 2.0}, ["p", "p", "q", "q"]).scores, expected,
                               rtol=1e-12)


def test_a_small_reward_is_heard_under_gdpo_and_drowned_under_sum():
    # A spreads by 100 within each group, B by 0.01; B disagrees with A in group 1
    groups = ["p", "p", "q", "q"]
    comps = {"A": [0.0, 100.0, 0.0, 100.0], "B": [0.0, 0.01, 0.01, 0.0]}
    summed = torch.tensor([a + b for a, b in zip(comps["A"], comps["B"])])
    plain = group_advantages(summed, groups).advantages
    assert plain[3] > plain[2]  # the sum: B's preference in group q is lost
    g = gdpo_scores(comps, {"A": 1.0, "B": 1.0}, groups, eps=0.0).scores
    np.testing.assert_allclose(g, [-2 / math.sqrt(2), 2 / math.sqrt(2), 0.0, 0.0], atol=1e-12)  # q: A and B cancel


def test_group_normalise_population_std_ties_and_whiten():
    z, sd, tied = group_normalise([1.0, 2.0, 3.0, 7.0, 7.0, 7.0], [0, 0, 0, 1, 1, 1], eps=0.0)
    np.testing.assert_allclose(z, [-math.sqrt(1.5), 0.0, math.sqrt(1.5), 0, 0, 0])  # std sqrt(2/3), not sqrt(1)
    assert tied == 1 and sd == pytest.approx(math.sqrt(2 / 3) / 2)
    assert (z[3:] == 0).all()
    np.testing.assert_allclose(whiten([1.0, 3.0], eps=0.0), [-1.0, 1.0])
    with pytest.raises(ValueError, match="groups has 2 entries for 3 values"):
        group_normalise([1.0, 2.0, 3.0], [0, 0])


def test_gdpo_advantages_are_the_clipped_aggregated_score_with_metrics():
    comps = {"A": [1.0, 3.0, 5.0, 5.0], "B": [0.0, 0.2, 0.4, 0.4]}
    rewards = torch.tensor([1.0, 3.4, 5.8, 5.8])
    adv = gdpo_advantages(comps, {"A": 1.0, "B": 2.0}, ["p", "p", "q", "q"], rewards, adv_clip_max=0.5)
    expected = gdpo_scores(comps, {"A": 1.0, "B": 2.0}, ["p", "p", "q", "q"]).scores.clip(-0.5, 0.5)
    assert torch.equal(adv.advantages, torch.from_numpy(expected).float())
    assert (adv.tied_groups, adv.num_groups) == (1, 2) and adv.tied_rewards == [pytest.approx(5.8)]
    assert adv.metrics["gdpo/A/tied_groups"] == 1 and adv.metrics["gdpo/B/tied_groups"] == 1
    assert adv.metrics["gdpo/A/group_std"] == pytest.approx(0.5)


def test_a_missing_component_names_the_function_and_the_sample():
    rows = [{"A": 1.0, "B": 0.5}, {"A": None, "B": 0.1}, {"B": float("nan")}]
    with pytest.raises(ValueError) as e:
        check_components(rows, ["A", "B"], ["req-0", "req-1", "req-2"])
    msg = str(e.value)
    assert "'A' for sample 'req-1'" in msg and "'A' for sample 'req-2'" in msg and "'B' for sample 'req-2'" in msg
    assert "req-0" not in msg
    assert check_components(rows[:1], ["A", "B"], ["req-0"]) == {"A": [1.0], "B": [0.5]}


def test_under_gdpo_an_optional_function_that_fails_fails_its_row_by_name():
    samples = [RewardSample(f"s{i}", make_image(v), f"prompt {i}") for i, v in enumerate((51, 102))]
    fns = {"px": {"fn": f"{FNS}:mean_pixel"}, "bad": {"fn": f"{FNS}:always_fail", "required": False,
                                                       "max_retries": 0}}
    flagged = asyncio.run(RewardManager({"functions": fns}).score(samples))
    assert [r.status for r in flagged] == ["flagged", "flagged"]  # sum: the component is missing, the row kept
    failed = asyncio.run(RewardManager({"functions": fns, "aggregation": "gdpo"}).score(samples))
    for r in failed:
        assert r.status == "failed" and r.score is None
        assert "bad: RuntimeError: scorer exploded" in r.error and "gdpo" in r.error
        assert r.components == {"px": pytest.approx(r.components["px"]), "bad": None}


def test_aggregation_config_names_the_field_and_values():
    base = {"reward": {"functions": {"c": {"fn": "prompt_colour"}}}}
    with pytest.raises(ConfigError, match=r"reward\.aggregation: Input should be 'sum' or 'gdpo'"):
        load_config({"reward": {**base["reward"], "aggregation": "mean"}})
    assert load_config(base).reward.aggregation == "sum"
    assert load_config({"reward": {**base["reward"], "aggregation": "gdpo"}}).reward.worker_config()[
        "aggregation"] == "gdpo"


def _config(model, aggregation):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5,
                     "max_sequence_length": 8},
        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "aggregation": aggregation,
                   "functions": {"colour": {"fn": "prompt_colour", "weight": 1.0},
                                 "jpeg": {"fn": "jpeg_compressibility", "weight": 0.01},
                                 # optional, weight 0: under gdpo a row it cannot score still fails, by name
                                 "marker": {"fn": f"{FNS}:fails_on_marked", "weight": 0.0, "required": False}}},
        "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"prompts": ["a blue car", "a green bird"], "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 8, "steps": 2, "num_threads": 1, "checkpoint_every": 0},
    })


def test_a_gdpo_training_step_logs_both_components_and_the_aggregated_reward(ray_cluster, tiny_sd3_path, tmp_path):
    from omniroll.train import Trainer

    out = str(tmp_path / "gdpo")
    with Trainer(_config(tiny_sd3_path, "gdpo"), out, log=lambda s: None) as tr:
        batches = []
        hist = tr.train(on_step=lambda m: batches.append(m))
        batch = asyncio.run(tr._rollout(3))
        adv = tr.algorithm.advantages(batch.batch["rm_scores"][:, 0].float(), list(batch.non_tensor_batch["uid"]),
                                      batch)
        marked = prompt_batch(["a red car fail-me"], 2, lambda i: "marked", data_source="train",
                              meta_info={"global_steps": 9, "rollout_seed": 0})
        with pytest.raises(AgentLoopError) as failed:  # a missing component fails its sample, named, never a 0
            asyncio.run(tr.manager.generate_sequences_async(marked))
    msg = str(failed.value)
    assert "2 of 2 rows failed" in msg and "request_id=" in msg and "uid='marked'" in msg
    assert "gdpo needs every component): marker: RuntimeError: this prompt is marked" in msg
    assert len(hist) == 2 and all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in hist)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:  # each function's own mean, its group spread, and the weighted sum (the aggregated reward)
        for key in ("reward/colour/mean", "reward/jpeg/mean", "gdpo/colour/group_std", "gdpo/jpeg/group_std",
                    "gdpo/colour/tied_groups", "gdpo/jpeg/tied_groups", "reward_mean"):
            assert key in r and math.isfinite(r[key]), key
        assert r["reward_mean"] == pytest.approx(r["reward/colour/mean"] + 0.01 * r["reward/jpeg/mean"], rel=1e-5)
    # the advantage is the whitened aggregate of the batch's own components: mean 0, std 1 (no group ties here)
    comps = {k: [info["components"][k] for info in batch.non_tensor_batch["reward_extra_info"]]
             for k in ("colour", "jpeg", "marker")}
    expected = gdpo_scores(comps, {"colour": 1.0, "jpeg": 0.01, "marker": 0.0},
                           list(batch.non_tensor_batch["uid"])).scores
    assert torch.equal(adv.advantages, torch.from_numpy(expected).clamp(-5, 5).float())
    assert abs(float(adv.advantages.mean())) < 1e-6


def test_sum_is_the_group_advantage_of_the_weighted_sum_bitwise(tiny_sd3_path):
    from omniroll.models import load_adapter
    from omniroll.train.algorithms import make_algorithm

    cfg = _config(tiny_sd3_path, "sum")
    algo = make_algorithm(cfg, load_adapter(tiny_sd3_path))
    rewards = torch.tensor([0.1, 0.7, 0.3, 0.3, 0.9, 0.2, 0.25, 0.6])
    uids = [0, 0, 0, 0, 1, 1, 1, 1]
    got = algo.advantages(rewards, uids)
    want = group_advantages(rewards, uids, cfg.trainer.global_std, cfg.trainer.adv_clip_max)
    assert torch.equal(got.advantages, want.advantages) and got.metrics == {}
