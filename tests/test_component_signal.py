"""The gradient-signal meter per reward component (omniroll/train/component_signal.py, `trainer.signal_components`):
each function's own advantages normalised as the aggregation normalises the total; on the tiny model a reward and its
negation read cos -1 and +1, two identical rewards +1, the reading matches the directions computed apart, and
reading it changes nothing in the update; a real training run logs it in metrics.jsonl and the trackers."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from omniroll.config import ConfigError, load_config
from omniroll.reward.aggregation import gdpo_scores
from omniroll.train.advantages import component_advantages, group_advantages
from omniroll.train.algorithms import UpdatePlan
from omniroll.train.component_signal import ComponentWindow, component_key
from omniroll.train.grad_signal import group_gradients, signal_halves
from omniroll.train.report.tracking import scalars
from omniroll.train.update import train_on_batch
from tests.test_grad_signal import PROMPTS, rollout_groups
from tests.test_grad_signal import fresh as grad_signal_fresh

FNS = "tests.reward_fns"


def test_component_advantages_are_normalised_as_the_aggregation_normalises_the_total():
    groups = [0, 0, 0, 1, 1, 1]
    r = [0.1, 0.5, 0.9, 0.2, 0.2, 0.3]
    s = [3.0, 1.0, 2.0, 5.0, 4.0, 4.0]
    got = component_advantages({"r": r, "s": s, "logged": s}, {"r": 2.0, "s": -1.0, "logged": 0.0}, groups, "sum")
    assert sorted(got) == ["r", "s"]  # weight 0: logged, never trained, no direction
    assert torch.equal(got["r"], group_advantages(torch.tensor(r, dtype=torch.float64) * 2, groups).advantages)
    assert torch.equal(got["s"], group_advantages(-torch.tensor(s, dtype=torch.float64), groups).advantages)
    assert float(got["s"][0]) < 0  # the highest s of its group trains down under a negative weight
    g = component_advantages({"r": r, "s": s}, {"r": 2.0, "s": -1.0}, groups, "gdpo")
    want = torch.from_numpy(gdpo_scores({"s": s}, {"s": -1.0}, groups).scores).clamp(-5, 5).float()
    assert torch.equal(g["s"], want)
    glob = component_advantages({"r": r}, {"r": 1.0}, groups, "sum", global_std=True, adv_clip_max=0.5)
    assert float(glob["r"].abs().max()) == 0.5  # clipped as the total is
    with pytest.raises(ValueError, match="aggregation must be sum or gdpo"):
        component_advantages({"r": r}, {"r": 1.0}, groups, "mean")


def test_the_window_counts_negative_readings_over_the_run_and_a_resume():
    w = ComponentWindow()
    assert w.metrics({}) == {} and w.metrics({"a": None}) == {}  # no direction: no reading
    w.metrics({"a": 0.5, "b": -0.2})
    m = w.metrics({"a": -0.1, "b": -0.3})
    assert m[component_key("a", "neg_share")] == 0.5 and m[component_key("b", "neg_share")] == 1.0
    assert m[component_key("a", "cos_total")] == -0.1 and m[component_key("a", "readings")] == 2
    resumed = ComponentWindow([{"step": 1, component_key("a", "cos_total"): 0.5},
                               {"step": 2, component_key("a", "cos_total"): -0.1}])
    assert resumed.metrics({"a": 0.3})[component_key("a", "neg_share")] == pytest.approx(1 / 3)
    assert scalars(m)["signal/component/a/cos_total"] == -0.1  # the trackers' name is the record's


def test_config_refuses_the_meter_without_two_weighted_functions_or_without_readings(tiny_sd3_path):
    base = {"engine": {"model": tiny_sd3_path}, "n": 2, "prompt_length": 77,
            "trainer": {"prompts": PROMPTS, "prompts_per_step": 2, "signal_components": True}}
    one = {"functions": {"r": {"fn": "jpeg_compressibility"}, "logged": {"fn": "jpeg_compressibility",
                                                                          "weight": 0.0}}}
    with pytest.raises(ConfigError, match=r"reward.functions needs at least 2 of nonzero weight, got \['r'\]"):
        load_config({**base, "reward": one})
    two = {"functions": {"r": {"fn": "jpeg_compressibility"}, "s": {"fn": "jpeg_compressibility"}}}
    with pytest.raises(ConfigError, match="signal_components: .* set signal_every >= 1"):
        load_config({**base, "reward": two, "trainer": {**base["trainer"], "signal_every": 0}})
    assert load_config({**base, "reward": two}).trainer.signal_components


def _config(tiny_sd3_path, kl_beta):
    return load_config({"engine": {"model": tiny_sd3_path},
                        "reward": {"functions": {"r": {"fn": "jpeg_compressibility"}}},
                        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 5, "max_sequence_length": 8},
                        "algo": {"noise_level": 0.8, "sde_type": "sde", "sde_window_size": 2,
                                 "sde_window_range": [0, 4]},
                        "n": 3, "prompt_length": 77,
                        "trainer": {"prompts": PROMPTS, "prompts_per_step": 5, "micro_batch_size": 4,
                                    "kl_beta": kl_beta}})


@pytest.fixture(scope="module")
def step_batch(tiny_sd3_path):
    cfg = _config(tiny_sd3_path, 0.0)
    traj, uids = rollout_groups(cfg, tiny_sd3_path, fresh(cfg, tiny_sd3_path)[0])
    g = torch.Generator().manual_seed(1)
    r = torch.rand(len(uids), generator=g, dtype=torch.float64)
    other = torch.rand(len(uids), generator=g, dtype=torch.float64)
    return traj, uids, r, other


def fresh(cfg, tiny_sd3_path):
    """test_grad_signal's fresh policy with a larger B: the policy is not the reference (the KL term has a gradient)."""
    return grad_signal_fresh(cfg, tiny_sd3_path, b_scale=1e-2)


def update(cfg, tiny_sd3_path, traj, uids, components, weights, aggregation="sum", signal=True):
    """One update of the step on fresh weights with the meter per component on `components` (None: off)."""
    policy, algorithm, store = fresh(cfg, tiny_sd3_path)
    total = sum(weights[k] * torch.as_tensor(v) for k, v in components.items())
    if aggregation == "gdpo":
        adv = torch.from_numpy(gdpo_scores(components, weights, uids).scores).clamp(-5, 5).float()
    else:
        adv = algorithm.advantages(total.float(), uids).advantages
    parts = component_advantages(components, weights, uids, aggregation)
    plan = UpdatePlan(step=1, seed=0, micro_batch_size=4, store=store, halves=signal_halves(uids, 0, 1),
                      signal=signal, components=parts if signal else None,
                      versions=torch.ones(len(traj), traj.num_steps, dtype=torch.long))
    anchors = algorithm.prepare(policy, traj, plan)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    stats = train_on_batch(policy, opt, algorithm, traj, adv, anchors, plan, num_inner_epochs=1, max_grad_norm=1.0)
    return stats, [p.detach().clone() for p in policy.parameters()], adv, parts


@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
def test_a_reward_and_its_negation_read_minus_one_and_identical_rewards_plus_one(step_batch, tiny_sd3_path,
                                                                              aggregation):
    traj, uids, r, _ = step_batch
    cfg = _config(tiny_sd3_path, 5.0)  # a KL term: the zero-advantage pass takes it out of every direction
    stats, _, adv, parts = update(cfg, tiny_sd3_path, traj, uids, {"up": r.tolist(), "down": (-r).tolist()},
                                  {"up": 2.0, "down": 1.0}, aggregation)
    assert stats.ratio_max_abs_dev == 0.0
    assert torch.allclose(parts["down"], -parts["up"], atol=1e-2) and torch.allclose(parts["up"], adv, atol=1e-2)
    assert stats.component_cos["up"] == pytest.approx(1.0, abs=1e-5)
    assert stats.component_cos["down"] == pytest.approx(-1.0, abs=1e-5)
    stats, *_ = update(cfg, tiny_sd3_path, traj, uids, {"a": r.tolist(), "b": r.tolist()}, {"a": 1.0, "b": 1.0},
                       aggregation)
    assert stats.component_cos["a"] == pytest.approx(1.0, abs=1e-5) == stats.component_cos["b"]


def test_the_reading_is_the_cosine_of_the_directions_computed_apart_and_changes_nothing(step_batch, tiny_sd3_path):
    traj, uids, r, other = step_batch
    cfg = _config(tiny_sd3_path, 0.0)
    comps, weights = {"r": r.tolist(), "other": other.tolist()}, {"r": 1.0, "other": 0.5}
    on, w_on, adv, parts = update(cfg, tiny_sd3_path, traj, uids, comps, weights)
    off, w_off, _, _ = update(cfg, tiny_sd3_path, traj, uids, comps, weights, signal=False)
    assert off.component_cos == {} and set(on.component_cos) == {"r", "other"}
    assert all(torch.equal(a, b) for a, b in zip(w_on, w_off))  # reading it changes nothing, bit for bit
    assert (on.loss, on.grad_norm) == (off.loss, off.grad_norm)
    policy, algorithm, store = fresh(cfg, tiny_sd3_path)  # each direction apart: its groups' gradients summed
    plan = UpdatePlan(step=1, seed=0, micro_batch_size=4, store=store,
                      versions=torch.ones(len(traj), traj.num_steps, dtype=torch.long))
    total = sum(group_gradients(policy, algorithm, traj, adv, uids, plan).values())
    for name in comps:
        d = sum(group_gradients(policy, algorithm, traj, parts[name], uids, plan).values())
        want = float(d @ total / (d.norm() * total.norm()))
        assert on.component_cos[name] == pytest.approx(want, abs=1e-5)
    assert min(abs(c) for c in on.component_cos.values()) < 0.999  # not a trivial reading


def test_a_training_run_logs_each_components_reading_and_its_negative_share(ray_cluster, tiny_sd3_path, tmp_path,
                                                                             monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omniroll.train import Trainer

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)

    cfg = load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": tiny_sd3_path, "max_batch_size": 16, "num_threads": 1},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "max_sequence_length": 8},
        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {
            "up": {"fn": f"{FNS}:scaled", "weight": 2.0},
            "down": {"fn": f"{FNS}:scaled", "kwargs": {"factor": -1.0}, "weight": 1.0}}},
        "n": 3, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"prompts": ["a blue car", "a green bird"], "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 8, "steps": 2, "num_threads": 1, "checkpoint_every": 0,
                    "signal_components": True, "logger": ["jsonl", "tensorboard"],
                    "experiment_name": "meter"}})
    out = str(tmp_path / "run")
    with Trainer(cfg, out, log=lambda s: None) as tr:
        hist = tr.train()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, filter(str.strip, f)) if "reward_mean" in r]
    assert len(steps) == len(hist) == 2
    for i, rec in enumerate(steps, 1):
        assert rec[component_key("up", "cos_total")] == pytest.approx(1.0, abs=1e-4)
        assert rec[component_key("down", "cos_total")] == pytest.approx(-1.0, abs=1e-4)
        assert rec[component_key("down", "neg_share")] == 1.0 and rec[component_key("up", "neg_share")] == 0.0
        assert rec[component_key("down", "readings")] == i
    acc = EventAccumulator(os.path.join(out, "tensorboard", "meter"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "signal/component/down/neg_share" in tags and "signal/component/up/cos_total" in tags
    assert math.isclose(acc.Scalars("signal/component/down/cos_total")[-1].value, -1.0, abs_tol=1e-4)


def test_two_ranks_read_what_one_process_reads(ray_cluster, tiny_sd3_path, tmp_path):
    """Data-parallel (`trainer.world_size: 2`): each rank adds its shard's component gradients, the all-reduce sums
    them, and the readings are the whole batch's, as one process reads them (up to the summation order)."""
    from omniroll.train import Trainer

    def cfg(world_size):
        return load_config({
            "replicas": {"count": 1, "num_cpus": 1},
            "engine": {"model": tiny_sd3_path, "max_batch_size": 16, "num_threads": 1},
            "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "max_sequence_length": 8},
            "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]},
            "agent": {"num_workers": 1},
            "reward": {"num_workers": 1, "aggregation": "gdpo",
                       "functions": {"colour": {"fn": "prompt_colour"}, "jpeg": {"fn": "jpeg_compressibility"}}},
            "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
            "trainer": {"prompts": ["a blue car", "a green bird", "a green car", "a blue bird"],
                        "prompts_per_step": 2, "lr": 0.01, "micro_batch_size": 2, "steps": 1, "num_threads": 1,
                        "checkpoint_every": 0, "world_size": world_size, "resources": {"num_cpus": 0},
                        "signal_components": True}})

    got = {}
    for n in (1, 2):
        with Trainer(cfg(n), str(tmp_path / f"n{n}"), log=lambda s: None) as tr:
            got[n] = tr.train()[0]
    for name in ("colour", "jpeg"):
        key = component_key(name, "cos_total")
        assert abs(got[1][key]) > 1e-3 and got[2][key] == pytest.approx(got[1][key], abs=1e-4), name
