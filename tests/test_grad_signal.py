"""The gradient-signal meter (omniroll/train/grad_signal.py, micro_batches.py): the step's micro-batches are cut half
by half of its prompt groups; the meter's reading is the cosine between the two halves' gradients as computed
separately; reading it changes nothing in the update; the signal-to-noise arithmetic."""

import math

import pytest
import torch

from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
from omniroll.config import load_config
from omniroll.train import TrajectoryBatch
from omniroll.train.algorithms import UpdatePlan, make_algorithm
from omniroll.train.grad_signal import (SignalWindow, fit_snr, group_gradients, samples_for_cos, signal_halves,
                                        signal_metrics, snr_from_cos)
from omniroll.train.micro_batches import epoch_micro_batches, group_rows
from omniroll.train.policy import Policy
from omniroll.train.update import train_on_batch
from omniroll.train.version_store import VersionStore
from omniroll.weights import WeightSender

PROMPTS = ["a red car", "a blue bird", "a green house", "a blue car", "a red bird"]


def test_halves_are_whole_prompt_groups_and_a_function_of_seed_and_step():
    uids = [u for u in "abcde" for _ in range(3)]
    h = signal_halves(uids, 0, 1)
    assert h.dtype == torch.bool and int(h.sum()) == 2 * 3  # 2 of 5 groups (rounded down), whole
    for u in "abcde":
        assert len({bool(h[i]) for i, x in enumerate(uids) if x == u}) == 1
    assert torch.equal(h, signal_halves(uids, 0, 1))
    assert any(not torch.equal(h, signal_halves(uids, 0, s)) for s in range(2, 6))
    assert signal_halves(["a"] * 4, 0, 1) is None  # one group: nothing to compare


@pytest.mark.parametrize("per_update", [None, 1, 2, 3])
def test_micro_batches_never_mix_halves_and_half_a_comes_first_in_each_accumulation_group(per_update):
    B, m = 23, 4
    halves = torch.tensor([i % 3 == 0 for i in range(B)])
    ep = epoch_micro_batches(B, halves, m, per_update, torch.Generator().manual_seed(5))
    assert sorted(torch.cat(ep.chunks).tolist()) == list(range(B))  # every row once
    for chunk, half in zip(ep.chunks, ep.half_a):
        assert len(chunk) <= m and {bool(halves[i]) for i in chunk.tolist()} == {half}
    for g in ep.groups:
        kinds = [ep.half_a[c] for c in g]
        assert kinds == sorted(kinds, reverse=True)  # A (True) before B (False)
        assert per_update is None or len(g) <= per_update
    assert per_update is not None or len(ep.groups) == 1
    assert ep.group_rows() == group_rows(B, int(halves.sum()), m, per_update)
    one_half = epoch_micro_batches(B, torch.ones(B, dtype=torch.bool), m, per_update, torch.Generator().manual_seed(5))
    assert all(len(c) for c in one_half.chunks) and set(one_half.half_a) == {True}  # a shard of one half only
    assert epoch_micro_batches(0, torch.ones(0, dtype=torch.bool), m, per_update, torch.Generator()).chunks == []
    plain = epoch_micro_batches(B, None, m, per_update, torch.Generator().manual_seed(5))
    assert [len(c) for c in plain.chunks] == [4, 4, 4, 4, 4, 3] and set(plain.half_a) == {None}


def test_signal_to_noise_arithmetic():
    # E cos = N s / (1 + N s): the diagnosis's rectified-flow numbers (s ~ 1.6e-3) give about 600 samples for 0.5
    s = 1.6e-3
    for n in (48, 96, 192, 384):
        assert snr_from_cos(n * s / (1 + n * s), n) == pytest.approx(s)
    assert samples_for_cos(s) == pytest.approx(625)
    assert snr_from_cos(-0.01, 48) == 0.0 and math.isinf(samples_for_cos(0.0))
    assert fit_snr([48, 96, 192, 384], [n * s / (1 + n * s) for n in (48, 96, 192, 384)]) == pytest.approx(s, rel=0.03)
    assert fit_snr([48, 96], [-0.01, 0.0]) == 0.0
    assert signal_metrics(None, 0, 0) == {}
    assert signal_metrics(0.2, 20, 28) == {"grad_cos": 0.2, "grad_cos_rows": 24}
    w = SignalWindow(3)
    assert w.metrics({}) == {}  # a step the meter did not read
    m = w.metrics(signal_metrics(0.2, 24, 24))
    assert m["grad_cos_mean"] == 0.2 and math.isnan(m["grad_cos_se"]) and m["grad_cos_readings"] == 1
    assert m["grad_snr"] == pytest.approx(0.2 / (24 * 0.8))
    for x in (0.1, 0.3, -0.4):
        m = w.metrics(signal_metrics(x, 24, 24))
    assert m["grad_cos_readings"] == 3 and m["grad_cos_mean"] == pytest.approx(0.0)  # the last 3: 0.1, 0.3, -0.4
    assert m["grad_cos_se"] == pytest.approx((sum(x * x for x in (0.1, 0.3, -0.4)) / 2 / 3) ** 0.5)
    assert m["grad_snr"] == 0.0 and m["grad_samples_for_cos50"] is None


@pytest.fixture(scope="module")
def step_batch(tiny_sd3_path):
    cfg = load_config({"engine": {"model": tiny_sd3_path},
                       "reward": {"functions": {"r": {"fn": "jpeg_compressibility"}}},
                       "pipeline": {"height": 32, "width": 32, "num_inference_steps": 5, "max_sequence_length": 8},
                       "algo": {"noise_level": 0.8, "sde_type": "sde", "sde_window_size": 2,
                                "sde_window_range": [0, 4]},
                       "n": 3, "prompt_length": 77,
                       "trainer": {"prompts": PROMPTS, "prompts_per_step": 5, "micro_batch_size": 4}})
    traj, uids = rollout_groups(cfg, tiny_sd3_path, fresh(cfg, tiny_sd3_path)[0])
    rewards = torch.tensor([float(x) for x in torch.linspace(0, 1, len(uids))[torch.randperm(
        len(uids), generator=torch.Generator().manual_seed(1))]])
    return cfg, traj, uids, rewards


def rollout_groups(cfg, tiny_sd3_path, policy, n: int = 3):
    """(trajectories, uids) of `n` samples per prompt of PROMPTS (seeds 10 i + j), rolled out with `policy`'s
    weights on an in-process engine."""
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    WeightSender([engine]).send(policy.weights_to_send(), version=1)
    try:
        sp = SamplingParams(**cfg.sampling_params())
        outs = engine.generate([GenerationRequest(request_id=f"{p}-{j}", prompt=p, seed=10 * i + j, sampling_params=sp)
                                for i, p in enumerate(PROMPTS) for j in range(n)])
    finally:
        engine.shutdown()
    return TrajectoryBatch.from_outputs(outs), [p for p in PROMPTS for _ in range(n)]


def fresh(cfg, tiny_sd3_path, b_scale: float = 1e-3):
    """(policy, algorithm, version store) at version 1: a rank-4 LoRA whose B is random * `b_scale` (non-zero, so
    every LoRA weight has a gradient)."""
    policy = Policy(tiny_sd3_path, "lora", 4, 8, None, seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for n, p in policy.denoiser.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    algorithm = make_algorithm(cfg, policy.adapter)
    store = VersionStore(policy, 0)
    store.record(1)
    return policy, algorithm, store


def test_the_meter_reads_the_cosine_of_the_two_halves_gradients_and_changes_nothing(step_batch, tiny_sd3_path):
    cfg, traj, uids, rewards = step_batch
    halves = signal_halves(uids, 0, 1)
    results = {}
    for signal in (True, False):
        policy, algorithm, store = fresh(cfg, tiny_sd3_path)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        adv = algorithm.advantages(rewards, uids).advantages
        plan = UpdatePlan(step=1, seed=0, micro_batch_size=4, versions=torch.ones(len(traj), traj.num_steps,
                                                                                   dtype=torch.long),
                          store=store, halves=halves, signal=signal)
        anchors = algorithm.prepare(policy, traj, plan)
        stats = train_on_batch(policy, opt, algorithm, traj, adv, anchors, plan, num_inner_epochs=1,
                               max_grad_norm=1.0)
        results[signal] = (stats, [p.detach().clone() for p in policy.parameters()])
    stats, weights = results[True]
    assert stats.ratio_max_abs_dev == 0.0 and results[False][0].grad_cos is None
    assert all(torch.equal(a, b) for a, b in zip(weights, results[False][1]))  # reading it changes nothing
    assert (stats.signal_rows_a, stats.signal_rows_b) == (int(halves.sum()), int((~halves).sum()))
    # the same cosine from each group's own gradient, computed apart
    policy, algorithm, store = fresh(cfg, tiny_sd3_path)
    adv = algorithm.advantages(rewards, uids).advantages
    plan = UpdatePlan(step=1, seed=0, micro_batch_size=4, store=store,
                      versions=torch.ones(len(traj), traj.num_steps, dtype=torch.long))
    grads = group_gradients(policy, algorithm, traj, adv, uids, plan)
    in_a = {u for u, h in zip(uids, halves.tolist()) if h}
    a = sum(g for u, g in grads.items() if u in in_a)
    b = sum(g for u, g in grads.items() if u not in in_a)
    want = float(a @ b / (a.norm() * b.norm()))
    assert stats.grad_cos == pytest.approx(want, abs=1e-6) and abs(want) > 1e-4
