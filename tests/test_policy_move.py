"""How far an update moved the policy (`omniroll.train.report.policy_move`), on real rollouts of the tiny SD3 for every
SDE type: the snapshot is the rollout's own log-prob bitwise (its execution mode), unchanged weights move exactly 0.0,
and `policy_kl` is the exact KL of the transition Gaussians (torch.distributions), which `kl_to_reference` gives for
cps / dance_sde and times |dt| for sde. In the trainer (sync and async, LoRA and full; training unchanged):
tests/test_train_report.py, tests/test_train.py."""

import pytest
import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.config import ConfigError, load_config
from omniroll.train import TrajectoryBatch, kl_to_reference
from omniroll.train.policy import Policy
from omniroll.train.report.policy_move import policy_move, snapshot


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_the_move_is_the_exact_transition_kl_and_exactly_zero_without_a_change(engine, tiny_sd3_path, sde_type):
    policy = Policy(tiny_sd3_path, "lora", rank=4, alpha=8.0)  # B = 0: the rollout's weights
    sp = SamplingParams(height=32, width=32, num_inference_steps=5, guidance_scale=4.5, max_sequence_length=8,
                        noise_level=0.8, sde_type=sde_type, sde_window_size=2, sde_window_range=(0, 4))
    traj = TrajectoryBatch.from_outputs(engine.generate(
        [GenerationRequest(request_id=f"m{i}", prompt=["a red car", "a blue bird"][i % 2], seed=i,
                           sampling_params=sp) for i in range(3)]))
    before = snapshot(policy.adapter, traj, rows=2, micro_batch_size=1)
    assert torch.equal(before.log_prob, traj.log_probs[:2])  # the first 2 rows, in the rollout's own mode
    assert snapshot(policy.adapter, traj, rows=0, micro_batch_size=1) is None
    unchanged = snapshot(policy.adapter, traj, rows=2, micro_batch_size=2)
    assert policy_move(before, unchanged, clip_range=1e-4) == {"policy_kl": 0.0, "post_approx_kl": 0.0,
                                                               "post_clip_frac": 0.0}

    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    after = snapshot(policy.adapter, traj, rows=2, micro_batch_size=2)
    move = policy_move(before, after, clip_range=1e-4)
    kls, flow_grpo = [], []
    for k in range(traj.num_steps):
        s = before.std[:, k]
        assert torch.equal(s, after.std[:, k]) and (s > 0).all()  # the std does not depend on the weights
        exact = torch.distributions.kl_divergence(
            torch.distributions.Normal(before.mean[k].double(), s.double().view(-1, 1, 1, 1)),
            torch.distributions.Normal(after.mean[k].double(), s.double().view(-1, 1, 1, 1))).reshape(2, -1).mean(1)
        kls.append(exact)
        dt = traj.sigmas_next[:2, k] - traj.sigmas[:2, k]
        ref = kl_to_reference(after.mean[k], before.mean[k], s, dt, [sde_type] * 2).double()
        flow_grpo.append(ref / (-dt.double()) if sde_type == "sde" else ref)
    assert move["policy_kl"] > 0
    assert move["policy_kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-6)
    assert move["policy_kl"] == pytest.approx(float(torch.cat(flow_grpo).mean()), rel=1e-5)
    d = (after.log_prob - before.log_prob).double()
    assert move["post_approx_kl"] == pytest.approx(float(0.5 * (d * d).mean())) and move["post_approx_kl"] > 0
    assert move["post_clip_frac"] == float(((d.exp() - 1).abs() > 1e-4).double().mean())


def test_policy_move_rows_is_validated():
    base = {"reward": {"functions": {"c": {"fn": "prompt_colour"}}}, "n": 2,
            "trainer": {"prompts": ["a red car"], "prompts_per_step": 1}}
    assert load_config(base).trainer.policy_move_rows == 8
    with pytest.raises(ConfigError, match="trainer.policy_move_rows") as e:
        load_config({**base, "trainer": {**base["trainer"], "policy_move_rows": -1}})
    assert "greater than or equal to 0" in str(e.value)
