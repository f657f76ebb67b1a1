"""Each training algorithm against its reference, as pure functions: DiffusionNFT's loss, advantage map and
old-weight decay; GRPO-Guard's normalised ratio; DanceGRPO's step noise and step draw; AWM's weighting; MixGRPO's
sliding window; and the configuration rules of `trainer.algorithm`."""

import math

import pytest
import torch

from omniroll.config import ConfigError, load_config
from omniroll.sampling.sde import sde_step
from omniroll.sampling.window import window_for_step
from omniroll.train.algorithms.awm import awm_policy_loss, awm_weight
from omniroll.train.algorithms.dance_grpo import trained_steps
from omniroll.train.algorithms.forward import draw_timesteps
from omniroll.train.algorithms.grpo_guard import guard_log_ratio, guard_loss
from omniroll.train.algorithms.nft import nft_policy_loss, old_decay, optimality_probability


def batch(seed=0, B=6, shape=(4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old = (torch.randn(B, *shape, generator=g) for _ in range(3))
    t = torch.rand(B, generator=g) * 0.9 + 0.05
    tv = t.view(-1, 1, 1, 1)
    return x0, eps, v_old, t, (1 - tv) * x0 + tv * eps


# ------------------------------------------------------------------------------------------------ DiffusionNFT
def test_nft_at_theta_old_is_advantage_signed_flow_matching_and_r_half_gives_no_gradient():
    x0, eps, v_old, t, x_t = batch()
    B, D = x0.shape[0], x0[0].numel()
    r = torch.tensor([0.0, 0.2, 0.5, 0.7, 0.9, 1.0])
    for beta in (1.0, 0.1):
        v = v_old.clone().requires_grad_(True)
        nft_policy_loss(v, v_old, x_t, x0, t, r, beta, 5.0, 1e-5).backward()
        u = eps - x0  # the flow-matching target
        w = (t.view(-1, 1, 1, 1) * (v_old - u)).abs().double().reshape(B, -1).mean(1).float()
        # d/dv of mean_rows((r L_pos + (1 - r) L_neg) / beta * 5) at v = v_old: 10 (2r - 1) t^2 (v - u) / (w D B)
        want = (10 * (2 * r - 1) * t**2 / (w * D * B)).view(-1, 1, 1, 1) * (v_old - u)
        assert torch.allclose(v.grad, want, rtol=1e-5, atol=1e-9), (beta, (v.grad - want).abs().max())
    # r = 0.5 everywhere: the two implicit policies pull equally, the gradient is exactly zero (beta 1, the default)
    v = v_old.clone().requires_grad_(True)
    nft_policy_loss(v, v_old, x_t, x0, t, torch.full((6,), 0.5), 1.0, 5.0, 1e-5).backward()
    assert torch.equal(v.grad, torch.zeros_like(v))


def test_nft_advantage_to_optimality_probability_and_old_decay_follow_the_reference():
    a = torch.tensor([-9.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])
    # train_nft_sd3.py: A_c = clamp(A, -5, 5); r = clamp(A_c / 5 / 2 + 0.5, 0, 1)
    assert torch.equal(optimality_probability(a, 5.0), torch.clamp(torch.clamp(a, -5, 5) / 5 / 2 + 0.5, 0, 1))
    assert optimality_probability(a, 5.0).tolist() == [0.0, 0.0, 0.25, 0.5, 0.6000000238418579, 1.0, 1.0]
    # return_decay: type 0 on-policy, type 1 min(0.001 step, 0.5), type 2 zero before 75 then min(0.0075 (s-75), .999)
    assert [old_decay(s, 0) for s in (0, 10, 900)] == [0.0, 0.0, 0.0]
    assert [old_decay(s, 1) for s in (0, 10, 499, 500, 900)] == [0.0, 0.01, 0.499, 0.5, 0.5]
    assert [old_decay(s, 2) for s in (0, 74, 75, 100, 300)] == [0.0, 0.0, 0.0, 0.0075 * 25, 0.999]


def test_nft_adaptive_weight_is_floored_and_loss_is_the_reference_formula():
    x0, eps, v_old, t, x_t = batch(1)
    v = v_old + 0.01 * torch.randn(v_old.shape, generator=torch.Generator().manual_seed(3))
    r = torch.linspace(0, 1, 6)
    beta = 0.1
    got = nft_policy_loss(v, v_old, x_t, x0, t, r, beta, 5.0, 1e-5)
    tv = t.view(-1, 1, 1, 1)
    x_pos, x_neg = x_t - tv * (beta * v + (1 - beta) * v_old), x_t - tv * ((1 + beta) * v_old - beta * v)
    w_pos = (x_pos - x0).abs().mean((1, 2, 3)).clamp(min=1e-5)
    w_neg = (x_neg - x0).abs().mean((1, 2, 3)).clamp(min=1e-5)
    want = torch.mean((r * ((x_pos - x0) ** 2).mean((1, 2, 3)) / w_pos
                       + (1 - r) * ((x_neg - x0) ** 2).mean((1, 2, 3)) / w_neg) / beta * 5)
    assert torch.allclose(got, want, rtol=1e-6)


# -------------------------------------------------------------------------------------------------- GRPO-Guard
def test_grpo_guard_log_ratio_is_the_noise_projection_of_the_mean_shift_and_has_zero_mean_over_the_noise():
    g = torch.Generator().manual_seed(0)
    B, shape = 8, (4, 8, 8)
    x, v_old = torch.randn(B, *shape, generator=g), torch.randn(B, *shape, generator=g)
    v = v_old + 0.05 * torch.randn(B, *shape, generator=g)
    step = dict(sigma=torch.full((B,), 0.7), sigma_next=torch.full((B,), 0.6), noise_level=0.8, sde_type="sde")
    xi = torch.randn(B, *shape, generator=g)
    ratios, plain = [], []
    for noise in (xi, -xi):  # antithetic draws of the step's noise
        old = sde_step(x, v_old, **step, noise=noise)
        new = sde_step(x, v, **step, prev_sample=old.prev_sample)
        lr = guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
        # (logp - logp_old + bias) s = mean(xi (mu_theta - mu_old)): no 1/s, no -||dmu||^2 / 2s^2 bias
        want = (noise * (new.mean - old.mean)).reshape(B, -1).mean(1)
        assert torch.allclose(lr, want, atol=1e-6), (lr - want).abs().max()
        ratios.append(lr)
        plain.append(new.log_prob - old.log_prob)
    assert torch.allclose(ratios[0] + ratios[1], torch.zeros(B), atol=1e-6)  # zero mean over the noise
    assert float(ratios[0].abs().max()) > 1e-4
    bias = ((new.mean - old.mean) ** 2).reshape(B, -1).mean(1) / (2 * new.std**2)  # Flow-GRPO's is biased below 0
    assert torch.allclose((plain[0] + plain[1]) / 2, -bias, rtol=1e-2, atol=2e-6) and bool((bias > 1e-5).all())


def test_grpo_guard_loss_is_clipped_surrogate_over_mean_sqrt_dt_squared():
    lr = torch.tensor([0.0, 1e-6, -1e-6, 3e-6]).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    sqrt_dt = torch.sqrt(torch.tensor([0.1, 0.1, 0.1, 0.1]))
    t = guard_loss(lr, adv, 2e-6, sqrt_dt)
    r = torch.exp(lr.detach())
    want = torch.mean(torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - 2e-6, 1 + 2e-6))) / 0.1
    assert torch.allclose(t.loss.detach(), want, rtol=1e-6) and t.clipped.tolist() == [False, False, False, True]


# --------------------------------------------------------------------------------------------------- DanceGRPO
def test_dance_grpo_step_std_and_trained_steps():
    B = 5
    sig, nxt = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.1]), torch.tensor([0.9, 0.5, 0.3, 0.1, 0.0])
    x, v = torch.randn(B, 4, 4, 4), torch.randn(B, 4, 4, 4)
    out = sde_step(x, v, sig, nxt, 0.3, "dance_sde", generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out.std, 0.3 * torch.sqrt(sig - nxt), rtol=1e-6)  # eta sqrt(sigma_i - sigma_{i+1})
    steps = trained_steps(16, 9, 0.6, seed=3, step=7)
    assert steps.shape == (16, 5)  # int(9 * 0.6) per row
    assert all(len(set(r.tolist())) == 5 and 0 <= min(r) and max(r) < 9 for r in steps)
    assert len({tuple(r.tolist()) for r in steps}) > 1  # drawn per row
    assert torch.equal(steps, trained_steps(16, 9, 0.6, seed=3, step=7))  # a function of (seed, step): resumable
    assert trained_steps(4, 2, 0.1, 0, 1).shape == (4, 1)  # at least one


# --------------------------------------------------------------------------------------------------------- AWM
def test_awm_is_flow_matching_weighted_by_the_advantage():
    x0, eps, _, t, x_t = batch(2)
    B = x0.shape[0]
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.3])
    v0 = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    v = v0.clone().requires_grad_(True)
    loss, ratio = awm_policy_loss(v, eps - x0, t, adv, "mse", 0.25, 1e-3)
    assert torch.equal(ratio, torch.ones(B)) and torch.allclose(loss, -adv.mean())  # on-policy: ratio 1 in value
    loss.backward()
    ref = v0.clone().requires_grad_(True)  # flow matching, each row weighted by A t
    (torch.mean(adv * t * ((ref - (eps - x0)) ** 2).mean((1, 2, 3)))).backward()
    assert torch.allclose(v.grad, ref.grad, rtol=1e-6, atol=1e-12)
    err = torch.tensor([0.0, 0.5, 2.0])
    tt = torch.tensor([0.2, 0.5, 0.9])
    want = (tt / 0.25) * ((err + 1e-3) ** 0.25 - 1e-3**0.25)
    assert torch.allclose(awm_weight(err, tt, "ghuber", 0.25, 1e-3), want) and awm_weight(err, tt, "mse", 0, 0)[2] == \
        pytest.approx(1.8)


def test_forward_process_training_timesteps_are_the_rows_own_sampling_timesteps():
    sig = torch.linspace(1, 0, 11).repeat(3, 1)
    t = draw_timesteps(sig, 9, seed=0, step=1, skip_first=False)
    assert t.shape == (3, 9) and all(len(set(r.tolist())) == 9 for r in t)
    assert set(t.flatten().tolist()) <= set(sig[0, :-1].tolist())
    t = draw_timesteps(sig, 6, seed=0, step=1, skip_first=True)
    assert t.shape == (3, 6) and float(t.max()) < 1.0  # AWM: after the first timestep
    assert torch.equal(t, draw_timesteps(sig, 6, seed=0, step=1, skip_first=True))


# ------------------------------------------------------------------------------------------------------- MixGRPO
def reference_mixgrpo_windows(iters: int, iters_per_group: int, group_size: int, max_timesteps: int):
    """MixGRPO's GRPOTrainingStates (progressive, prog_overlap, prog_overlap_step 1, roll_back), transcribed."""
    cur, in_group, out = 0, 0, []
    for _ in range(iters):
        out.append(list(range(cur, min(cur + group_size, max_timesteps))))
        in_group += 1
        if in_group >= iters_per_group:
            in_group = 0
            cur += 1
        if cur > max_timesteps:
            cur, in_group = 0, 0
    return out


def test_online_dpo_pairs_each_groups_best_and_worst_and_its_gradient_at_the_reference_is_beta_half():
    """The worked example of writing an algorithm (omniroll/train/algorithms/online_dpo.py): a group's winner is its
    row of largest advantage and its loser its row of smallest (the first of equals), a tied group gives no pair; at
    d = 0 (theta = ref) each pair's loss is log 2 and the gradient on d is +beta / 2 on the winner, -beta / 2 on the
    loser, over the rows; without a pair the loss is 0 with a zero gradient."""
    from omniroll.train.algorithms.online_dpo import dpo_loss, preference_pairs

    adv = torch.tensor([0.5, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, -0.2, 0.3])
    keys = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    winners, losers = preference_pairs(adv, keys)
    assert winners.tolist() == [2, 9] and losers.tolist() == [1, 8]
    d = torch.zeros(10, requires_grad=True)
    loss = dpo_loss(d, winners, losers, beta=100.0)
    assert float(loss.detach()) == pytest.approx(2 * math.log(2) / 10, rel=1e-6)
    loss.backward()
    want = torch.zeros(10)
    want[[2, 9]], want[[1, 8]] = 100.0 / 2 / 10, -100.0 / 2 / 10
    assert torch.allclose(d.grad, want)
    d.grad = None
    none = dpo_loss(d, *preference_pairs(torch.zeros(10), keys), beta=100.0)
    none.backward()
    assert float(none.detach()) == 0.0 and not d.grad.any()


def test_progressive_window_slides_as_mixgrpo():
    T, size, every = 10, 4, 3
    ref = reference_mixgrpo_windows(80, every, size, T - 1)
    ours = [window_for_step("progressive", s, T, size, None, 0, every) for s in range(1, 81)]
    # the same windows, except that the reference also visits the empty window at start == max once per cycle
    ref_nonempty = [w for w in ref if w]
    assert [list(range(a, b)) for a, b in ours][: len(ref_nonempty) - 5] == ref_nonempty[: len(ref_nonempty) - 5]
    assert ours[0] == (0, 4) and ours[3] == (1, 5) and (8, 9) in ours and ours.count((0, 4)) >= 6  # rolled back


# ------------------------------------------------------------------------------------------------------ config
def cfg(trainer, algo=None, **top):
    return load_config({"n": 4, "engine": {"model": "shapes"}, "reward": {"functions": {"g": {"fn": "shapes"}}},
                        "algo": algo or {}, **top,
                        "trainer": {"prompts": ["a red circle"], "prompts_per_step": 1, **trainer}})


def test_algorithm_options_are_validated_and_keys_that_do_not_apply_are_errors():
    c = cfg({"algorithm": "nft"})
    assert (c.trainer.kl_beta, c.trainer.global_std) == (1e-4, True)  # the reference's defaults
    assert c.trainer.options().beta == 1.0 and cfg({"algorithm": "grpo_guard"}).trainer.clip_range == 2e-6
    assert cfg({"algorithm": "nft", "kl_beta": 0.0}).trainer.kl_beta == 0.0  # set: kept
    bad = [({"algorithm": "nft", "clip_range": 0.1}, None,
            "trainer.clip_range does not apply to trainer.algorithm nft"),
           ({"algorithm": "awm", "window_schedule": "random"}, None, "trainer.window_schedule does not apply"),
           ({"algorithm": "nft"}, {"noise_level": 0.5}, "algo.noise_level does not apply to trainer.algorithm nft"),
           ({"algorithm": "nft", "algorithm_options": {"betta": 1}}, None, "algorithm_options.betta: Extra inputs"),
           ({"algorithm": "nft", "algorithm_options": {"beta": 0}}, None, "algorithm_options.beta: Input should be"),
           ({"algorithm_options": {"beta": 1.0}}, None, "algorithm_options.beta: Extra inputs are not permitted "
                                                        "(trainer.algorithm flow_grpo)"),
           ({"algorithm": "dance_grpo"}, {"sde_type": "dance_sde"}, "algo.same_latent: trainer.algorithm dance_grpo"),
           ({"algorithm": "dance_grpo"}, None, "algo.sde_type: trainer.algorithm dance_grpo samples with dance_sde"),
           ({"algorithm": "grpo_guard"}, {"sde_type": "cps"}, "algo.sde_type: trainer.algorithm grpo_guard"),
           ({"algorithm": "ppo"}, None, "trainer.algorithm: Input should be")]
    for trainer, algo, msg in bad:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            cfg(trainer, algo)
    dumped = cfg({"algorithm": "awm"}).model_dump(mode="json")  # a saved config (every key) loads again
    assert load_config(dumped).trainer.algorithm == "awm" and not math.isnan(load_config(dumped).trainer.kl_beta)


def test_every_registered_algorithm_is_configurable_trained_end_to_end_and_has_a_shapes_recipe_and_a_docs_row(
        monkeypatch):
    """`ALGORITHMS` is the one list of algorithms: the config's choices, the trainer's classes (each in the file named
    after it), the FSDP ones, the CLI's help and the config's description derive from it; each has a recipe under
    examples/ and a row in the docs' algorithm table (tests/test_algorithms_train.py trains every one of them)."""
    import os
    import re
    import typing

    from omniroll.cli.train import HELP
    from omniroll.config.algorithms import ALGORITHMS, AlgorithmName, fsdp_algorithms
    from omniroll.config.trainer import TrainerSection
    from omniroll.train.algorithms import REGISTRY, algorithm_class

    names = set(ALGORITHMS)
    assert set(typing.get_args(AlgorithmName)) == names == set(REGISTRY)
    assert all(REGISTRY[n].__module__ == f"omniroll.train.algorithms.{n}" and REGISTRY[n].name == n for n in names)
    assert set(fsdp_algorithms()) == {n for n in names if ALGORITHMS[n].fsdp} <= names
    description = TrainerSection.model_fields["algorithm"].description
    assert all(ALGORITHMS[n].title in HELP and re.search(rf"\b{n}\b", description) for n in names)
    with pytest.raises(ValueError, match="trainer.algorithm: one of"):
        algorithm_class("ppo")
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "docs", "training", "algorithms.md")) as f:
        rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", f.read(), re.M)}
    missing = sorted(names - rows)
    assert not missing, f"docs/training/algorithms.md: no row of the algorithm table for {missing}"
    with open(os.path.join(root, "README.md")) as f:
        readme_row = next(line for line in f if line.startswith("| algorithms |"))
    missing = sorted(ALGORITHMS[n].title for n in names if ALGORITHMS[n].title not in readme_row)
    assert not missing, f"README.md: the features table's algorithms row does not name {missing}"
    monkeypatch.chdir(root)  # the recipes name their prompt files from the repository's root
    for name in names:  # one recipe per algorithm, so trying another one is one file
        path = os.path.join(root, "examples", f"shapes_{name}.yaml")
        assert os.path.isfile(path), f"examples/shapes_{name}.yaml: registered algorithm {name} has no recipe"
        cfg = load_config(path)
        assert cfg.trainer.algorithm == name and cfg.trainer.evaluation is not None
