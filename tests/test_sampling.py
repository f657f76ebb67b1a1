"""Sampling math against hand-computed values and against diffusers."""

import math
import os
import subprocess
import sys

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omniroll.sampling import derive_seed, draw_sde_window, make_generator, sde_step


def one(x):
    return torch.tensor([[x]], dtype=torch.float32)


def test_sde_matches_hand_computation():
    x, v, s, sn, eta, eps = 1.0, 0.5, 0.8, 0.6, 0.7, 0.5
    std_t = eta * math.sqrt(s / (1 - s))
    dt = sn - s
    mean = x * (1 + std_t**2 * dt / (2 * s)) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * math.sqrt(-dt)
    prev = mean + std * eps
    logp = -((prev - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    out = sde_step(one(x), one(v), s, sn, eta, "sde", noise=one(eps))
    assert out.prev_sample.item() == pytest.approx(prev, rel=1e-6)
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.log_prob.shape == (1,)
    assert out.log_prob.item() == pytest.approx(logp, rel=1e-5)


def test_sde_at_sigma_one_uses_sigma_max():
    x, v, sn, eta, smax = 0.3, -0.2, 0.9, 0.7, 0.95
    std_t = eta * math.sqrt(1.0 / (1 - smax))
    mean = x * (1 + std_t**2 * (sn - 1) / 2) + v * (1 + 0) * (sn - 1)
    out = sde_step(one(x), one(v), 1.0, sn, eta, "sde", noise=one(0.0), sigma_max=smax)
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(one(x), one(v), 1.0, sn, eta, "sde", noise=one(0.0))


def test_cps_matches_hand_computation():
    x, v, s, sn, eta, eps = 1.0, 0.5, 0.8, 0.6, 0.8, -0.3
    std = sn * math.sin(eta * math.pi / 2)
    mean = (1 - sn) * (x - s * v) + math.sqrt(sn**2 - std**2) * (x + (1 - s) * v)
    prev = mean + std * eps
    out = sde_step(one(x), one(v), s, sn, eta, "cps", noise=one(eps))
    assert out.prev_sample.item() == pytest.approx(prev, rel=1e-6)
    assert out.log_prob.item() == pytest.approx(-((prev - mean) ** 2), rel=1e-5)  # as published: unscaled


def test_ode_and_zero_noise_equal_diffusers_euler_step_bitwise():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(6)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=g)
        ref = sched.step(v, t, x).prev_sample
        s, sn = sched.sigmas[i], sched.sigmas[i + 1]
        for kind, eta in (("ode", 0.7), ("sde", 0.0), ("cps", 0.0)):
            out = sde_step(x, v, s, sn, eta, kind, sigma_max=sched.sigmas[1])
            assert torch.equal(out.prev_sample, ref), (i, kind)
            assert torch.equal(out.log_prob, torch.zeros(2))
        x = ref


def test_recompute_log_prob_equals_rollout_exactly():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    for kind in ("sde", "cps"):
        roll = sde_step(x, v, 0.7, 0.55, 0.8, kind, generator=make_generator(5))
        again = sde_step(x, v, 0.7, 0.55, 0.8, kind, prev_sample=roll.prev_sample)
        assert torch.equal(roll.log_prob, again.log_prob)
        assert torch.isfinite(roll.log_prob).all()


def test_per_row_parameters_equal_rows_alone():
    g = torch.Generator().manual_seed(2)
    x, v, eps = (torch.randn(4, 4, 6, 6, generator=g) for _ in range(3))
    sig = torch.tensor([0.9, 0.7, 0.5, 1.0])
    nxt = torch.tensor([0.8, 0.6, 0.3, 0.9])
    eta = torch.tensor([0.7, 0.8, 0.0, 1.0])
    kinds = ["sde", "cps", "sde", "sde"]
    smax = torch.full((4,), 0.95)
    batch = sde_step(x, v, sig, nxt, eta, kinds, noise=eps, sigma_max=smax)
    for i in range(4):
        alone = sde_step(x[i:i + 1], v[i:i + 1], sig[i].item(), nxt[i].item(), eta[i].item(), kinds[i],
                         noise=eps[i:i + 1], sigma_max=0.95)
        assert torch.equal(batch.prev_sample[i], alone.prev_sample[0])
        assert torch.equal(batch.log_prob[i], alone.log_prob[0])


def test_reduce_sum_and_bad_arguments():
    x = torch.randn(2, 3, 4, 4)
    a = sde_step(x, x, 0.5, 0.4, 0.7, "sde", noise=x)
    b = sde_step(x, x, 0.5, 0.4, 0.7, "sde", noise=x, reduce="sum")
    assert torch.allclose(b.log_prob, a.log_prob * 48, rtol=1e-5)
    with pytest.raises(ValueError, match="sde_type"):
        sde_step(x, x, 0.5, 0.4, 0.7, "bogus")
    with pytest.raises(ValueError, match="reduce"):
        sde_step(x, x, 0.5, 0.4, 0.7, "sde", reduce="max")
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x, x, torch.tensor([0.5, 0.4, 0.3]), 0.4, 0.7, "sde")
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(x, x, 0.5, 0.4, -1.0, "sde")


def test_derive_seed_is_stable_and_position_free():
    s = derive_seed(42, 3, "uid-a", 0)
    assert s == derive_seed(42, 3, "uid-a", 0)
    assert 0 <= s < 2**63
    others = {derive_seed(43, 3, "uid-a", 0), derive_seed(42, 4, "uid-a", 0),
              derive_seed(42, 3, "uid-b", 0), derive_seed(42, 3, "uid-a", 1)}
    assert s not in others and len(others) == 4
    code = "from omniroll.sampling.seeds import derive_seed; print(derive_seed(42, 3, 'uid-a', 0))"
    env = dict(os.environ, PYTHONHASHSEED=str(hash("x") % 1000 + 1))  # another process, another hash seed
    assert int(subprocess.check_output([sys.executable, "-c", code], env=env)) == s


def test_sde_windows():
    assert draw_sde_window(10, None, None, None) == (0, 9)
    starts = set()
    for seed in range(200):
        start, end = draw_sde_window(10, 3, (0, 5), make_generator(seed))
        assert 0 <= start <= 2 and end == start + 3
        starts.add(start)
        assert (start, end) == draw_sde_window(10, 3, (0, 5), make_generator(seed))
    assert starts == {0, 1, 2}
    with pytest.raises(ValueError, match="sde_window_size"):
        draw_sde_window(10, 6, (0, 5), None)


def test_the_schedule_is_the_checkpoint_schedulers_own():
    """Sigma schedules have one home, the model adapters (models/_flow.py): the checkpoint's scheduler, bitwise."""
    from omniroll.models._flow import pipeline_sigmas

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    assert torch.equal(pipeline_sigmas(dict(sched.config), 10), sched.sigmas.float())


def test_log_prob_of_a_row_is_bitwise_independent_of_its_batch():
    # A reduction over [B, ...] changes its summation order with B; each row must be reduced on its own.
    g = torch.Generator().manual_seed(3)
    x, v, eps = (torch.randn(16, 16, 48, 48, generator=g) for _ in range(3))
    for kind in ("sde", "cps"):
        for reduce in ("mean", "sum"):
            batch = sde_step(x, v, 0.7, 0.6, 0.8, kind, noise=eps, reduce=reduce).log_prob
            for i in range(16):
                alone = sde_step(x[i:i + 1], v[i:i + 1], 0.7, 0.6, 0.8, kind, noise=eps[i:i + 1], reduce=reduce)
                assert torch.equal(batch[i], alone.log_prob[0]), (kind, reduce, i)


def test_dance_sde_matches_hand_computation():
    # VeRL-Omni's dance_sde: mean = x + dt v - 0.5 eta^2 score dt, score = -(x - (1 - s) x0) / s^2,
    # std = eta sqrt(s - sn)
    x, v, s, sn, eta, eps = 1.0, 0.5, 0.8, 0.6, 0.7, 0.5
    dt = sn - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    std = eta * math.sqrt(s - sn)
    prev = mean + std * eps
    logp = -((prev - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    out = sde_step(one(x), one(v), s, sn, eta, "dance_sde", noise=one(eps))
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.prev_sample.item() == pytest.approx(prev, rel=1e-6)
    assert out.log_prob.item() == pytest.approx(logp, rel=1e-5)
    # at sigma == 1 it needs no sigma_max (no 1 / (1 - sigma) term); recompute is exact; eta == 0 is Euler
    top = sde_step(one(x), one(v), 1.0, 0.9, eta, "dance_sde", noise=one(eps))
    assert torch.isfinite(top.log_prob).all()
    again = sde_step(one(x), one(v), 1.0, 0.9, eta, "dance_sde", prev_sample=top.prev_sample)
    assert torch.equal(again.log_prob, top.log_prob)
    assert sde_step(one(x), one(v), s, sn, 0.0, "dance_sde").prev_sample.item() == pytest.approx(x + dt * v)


def test_dance_sde_rows_mix_with_other_types():
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    eps = torch.randn(3, 2, 4, 4, generator=g)
    types = ["sde", "dance_sde", "cps"]
    both = sde_step(x, v, 0.7, 0.5, 0.8, types, noise=eps)
    for i, t in enumerate(types):
        alone = sde_step(x[i:i + 1], v[i:i + 1], 0.7, 0.5, 0.8, t, noise=eps[i:i + 1])
        assert torch.equal(both.prev_sample[i], alone.prev_sample[0]), t
        assert torch.equal(both.log_prob[i], alone.log_prob[0]), t


def test_zero_noise_cps_scored_away_from_its_mean_is_minus_squared_error():
    # the last CPS step (sigma_next == 0: std == 0) and eta == 0 are deterministic; scoring a sample that is not the
    # mean must give what flow_grpo / VeRL-Omni give, -mean((x' - mu)^2), not a constant 0 (which would hide the move)
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    for sn, eta in ((0.0, 0.8), (0.4, 0.0)):
        at_mean = sde_step(x, v, 0.6, sn, eta, "cps")
        assert torch.equal(at_mean.log_prob, torch.zeros(2))
        moved = at_mean.prev_sample + 0.1
        scored = sde_step(x, v, 0.6, sn, eta, "cps", prev_sample=moved)
        expected = -((moved - at_mean.mean) ** 2).reshape(2, -1).mean(1)
        assert torch.allclose(scored.log_prob, expected, rtol=0, atol=1e-7)
        assert (scored.log_prob < 0).all()
