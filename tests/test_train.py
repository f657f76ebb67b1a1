"""`omniroll.train` end to end on a local Ray cluster: exact ratios after every sync (LoRA and full), weight versions,
bitwise resume, the checkpoint format, and GRPO's pieces."""

import json
import os

import pytest
import torch

from omniroll.config import load_config
from omniroll.train.advantages import group_advantages
from omniroll.train.algorithms.ppo import ppo_clip_loss

PROMPTS = ["a blue car", "a green bird"]


def train_config(model, functions=None, **trainer):
    """The tiny SD3's Flow-GRPO config these tests train with; `functions`: other reward functions than the prompt's
    colour."""
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5,
                     "max_sequence_length": 8},
        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": functions or {"colour": {"fn": "prompt_colour"}}},
        "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 2},
        "trainer": {"prompts": PROMPTS, "prompts_per_step": 2, "lr": 0.01, "micro_batch_size": 4, "steps": 4,
                    "num_threads": 1, **trainer},
    })


def lora_weights(ckpt):
    from safetensors.torch import load_file

    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


def test_lora_training_is_exact_every_step_ctrl_c_checkpoints_and_resumes_bitwise(ray_cluster, tiny_sd3_path, tmp_path,
                                                                                  monkeypatch, capsys):
    from omniroll.train import Trainer, WeightVersionError

    cfg = train_config(tiny_sd3_path, checkpoint_every=2, window_schedule="random")
    straight = str(tmp_path / "straight")
    with Trainer(cfg, straight, log=lambda s: None) as tr:
        hist = tr.train()
        # a replica that serves other weights than the pushed version makes the trainer raise
        tr.sender.send(tr.policy.weights_to_send(), version=tr.version + 5)
        with pytest.raises(WeightVersionError, match="version 4"):
            tr.step(5)
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0] * 4
    assert [m["weight_version"] for m in hist] == [0, 1, 2, 3]
    assert [m["synced_version"] for m in hist] == [1, 2, 3, 4]
    assert all(m["grad_norm"] > 0 and m["optimizer_steps"] == 1 for m in hist)
    assert all(m["policy_kl"] > 0 and m["post_approx_kl"] > 0 for m in hist)  # the update moved the policy
    lines = [json.loads(x) for x in open(os.path.join(straight, "metrics.jsonl"))]
    need = {"step", "reward_mean", "reward_std", "ratio_max_abs_dev", "clip_frac", "approx_kl", "loss", "grad_norm",
            "policy_kl", "post_approx_kl", "post_clip_frac", "weight_version", "rollout_s", "reward_wait_s",
            "train_s", "sync_s", "step_s", "policy_move_s"}
    assert len(lines) == 4 and all(need <= set(m) for m in lines)
    for f in ("reward_curve.png", "val_before.png", "val_after.png"):
        assert os.path.getsize(os.path.join(straight, f)) > 0

    # the CLI: Ctrl-C during the run writes the last completed step's checkpoint and exits 130; --resume continues it
    # to the same weights, bitwise, as the straight run
    import signal
    import threading
    import time

    import yaml

    from omniroll.cli import main

    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    resumed = str(tmp_path / "resumed")

    def interrupt_after_first_step():
        metrics = os.path.join(resumed, "metrics.jsonl")
        deadline = time.time() + 300
        while time.time() < deadline and not (os.path.exists(metrics) and open(metrics).read().count("\n") >= 1):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_after_first_step, daemon=True).start()
    assert main(["train", "--config", str(cfg_file), "--out", resumed, "--steps", "4", "--quiet"]) == 130
    with open(os.path.join(resumed, "checkpoints", "latest")) as f:
        stopped_at = int(f.read().strip().removeprefix("step_"))
    assert 1 <= stopped_at < 4
    # $OMNIROLL_OVERRIDES applies last, over every flag: its trainer.steps wins over --steps (train until step 4)
    monkeypatch.setenv("OMNIROLL_OVERRIDES", "trainer.steps=4")
    capsys.readouterr()
    assert main(["train", "--config", str(cfg_file), "--out", resumed, "--resume", resumed, "--steps", "9",
                 "--quiet"]) == 0
    assert "--steps 9 yields to $OMNIROLL_OVERRIDES's trainer.steps=4" in capsys.readouterr().err
    hist2 = [json.loads(x) for x in open(os.path.join(resumed, "metrics.jsonl"))]
    assert [m["step"] for m in hist2] == [1, 2, 3, 4] and all(m["ratio_max_abs_dev"] == 0.0 for m in hist2)
    a = lora_weights(os.path.join(straight, "checkpoints", "step_000004"))
    b = lora_weights(os.path.join(resumed, "checkpoints", "step_000004"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s_a = torch.load(os.path.join(straight, "checkpoints", "step_000004", "trainer_state.pt"), weights_only=False)
    s_b = torch.load(os.path.join(resumed, "checkpoints", "step_000004", "trainer_state.pt"), weights_only=False)
    assert all(torch.equal(s_a["optimizer"]["state"][i]["exp_avg"], s_b["optimizer"]["state"][i]["exp_avg"])
               for i in s_a["optimizer"]["state"])


#: Checked locally (shared 2-core VM, 2026-11-22) with seeds 0, 1 and 2: all pass, slope t-values 8.6, 8.5 and 5.1
#: (threshold 3). CI runs seed 0 only (a run costs ~30 s); OMNIROLL_LEARNING_SEEDS=0,1,2 runs all three.
LEARNING_SEEDS = [int(s) for s in os.environ.get("OMNIROLL_LEARNING_SEEDS", "0").split(",")]
LEARNING_STEPS = 20


def rise_t_value(rewards):
    """Least-squares slope of reward vs step divided by its standard error (from the residual step-to-step noise)."""
    y = torch.tensor(rewards, dtype=torch.float64)
    x = torch.arange(len(y), dtype=torch.float64)
    xc = x - x.mean()
    slope = (xc * (y - y.mean())).sum() / (xc * xc).sum()
    resid = y - y.mean() - slope * xc
    se = ((resid * resid).sum() / (len(y) - 2) / (xc * xc).sum()).sqrt()
    return float(slope / se)


@pytest.mark.parametrize("seed", LEARNING_SEEDS)
def test_full_finetuning_learns_exactly_with_kl_epochs_and_accumulation(ray_cluster, tiny_sd3_path, tmp_path, seed):
    """The prompt_colour reward rises: the slope of the per-step mean reward exceeds 3 standard errors of the slope,
    measured from the run's own step-to-step noise; every step's ratio is exact."""
    from omniroll.train import Trainer

    cfg = train_config(tiny_sd3_path, mode="full", kl_beta=0.001, num_inner_epochs=2, micro_batch_size=8,
                       micro_batches_per_update=2, steps=LEARNING_STEPS, lr=0.006, seed=seed, prompts_per_step=4,
                       prompts=["a blue car", "a green car", "a blue bird", "a green bird"])
    cfg = load_config(cfg, overrides=[f"seed={seed}", "n=6"])
    with Trainer(cfg, str(tmp_path / "full"), log=lambda s: None) as tr:
        hist = tr.train()
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0] * LEARNING_STEPS
    assert [m["optimizer_steps"] for m in hist] == [4] * LEARNING_STEPS  # 24 samples / 8 per micro-batch: 2 x 2 epochs
    assert all(m["kl"] > 0 for m in hist[1:]) and all(m["approx_kl"] > 0 for m in hist)
    assert all(m["policy_kl"] > 0 for m in hist)  # full fine-tuning: the move after 4 updates a step
    rewards = [m["reward_mean"] for m in hist]
    assert rise_t_value(rewards) > 3.0, [round(r, 4) for r in rewards]


def test_lora_checkpoint_loads_with_peft_onto_the_diffusers_transformer(ray_cluster, tiny_sd3_path, tmp_path):
    from peft import PeftModel

    from omniroll.models import load_adapter
    from omniroll.train.policy import Policy

    pol = Policy(tiny_sd3_path, "lora", rank=4, alpha=8, seed=3)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.05)
    pol.save(str(tmp_path / "ckpt"))
    fresh = load_adapter(tiny_sd3_path).denoiser
    peft_model = PeftModel.from_pretrained(fresh, str(tmp_path / "ckpt")).eval()
    x = dict(hidden_states=torch.randn(1, 16, 4, 4), encoder_hidden_states=torch.randn(1, 5, 32),
             pooled_projections=torch.randn(1, 64), timestep=torch.tensor([500.0]))
    with torch.no_grad():
        assert torch.equal(peft_model(**x).sample, pol.denoiser(**x).sample)
    other = Policy(tiny_sd3_path, "lora", rank=4, alpha=8, seed=9)
    other.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), pol.parameters()))


def test_group_advantages_and_ppo_clip_loss():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    a = group_advantages(r, ["a", "a", "a", "b", "b", "b"])
    sd = torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False).item()
    assert torch.allclose(a.advantages[:3], torch.tensor([-1.0, 0.0, 1.0]) / (sd + 1e-4))
    assert torch.equal(a.advantages[3:], torch.zeros(3)) and a.tied_groups == 1 and a.num_groups == 2
    g = group_advantages(r, ["a", "a", "a", "b", "b", "b"], global_std=True, adv_clip_max=0.5)
    assert g.advantages.abs().max() == 0.5
    old = torch.zeros(3)
    new = torch.tensor([0.0, 0.01, -0.01], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    t = ppo_clip_loss(new, old, adv, clip_range=1e-3)
    ratio = torch.exp(new.detach())
    want = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-3, 1 + 1e-3)).mean()
    assert torch.allclose(t.loss.detach(), want) and t.clipped.tolist() == [False, True, True]
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), ["a", "a"])


def test_bad_trainer_config_fails_before_anything_starts(tmp_path, monkeypatch, capsys):
    from omniroll.cli import main
    from omniroll.train import trainer

    monkeypatch.setattr(trainer.Trainer, "start", lambda self: pytest.fail("started despite a bad config"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("reward: {functions: {c: {fn: prompt_colour}}}\nn: 4\ntrainer: {prompts: [a red car], "
                   "prompts_per_step: 1, lr: -1}\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "trainer.lr" in capsys.readouterr().err
    bad.write_text("n: 4\ntrainer: {prompts: [a red car], prompts_per_step: 1}\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "reward.functions" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_flow_grpo_trainer_is_the_trainer_under_its_former_name():
    from omniroll.train import FlowGRPOTrainer, Trainer

    assert FlowGRPOTrainer is Trainer


def test_prompt_colour_reward():
    import numpy as np

    from omniroll.reward import RewardSample
    from omniroll.reward import prompt_colour

    red = np.zeros((3, 4, 4), dtype=np.uint8)
    red[0] = 255
    grey = np.full((3, 4, 4), 128, dtype=np.uint8)
    s = lambda img, p: RewardSample(sample_id="x", image=img, prompt=p)  # noqa: E731
    assert prompt_colour([s(red, "a red car"), s(red, "a blue car"), s(grey, "a Blue car")]) == \
        pytest.approx([1.0, -0.5, 0.0])
    with pytest.raises(ValueError, match="names no colour"):
        prompt_colour([s(red, "a car")])


def test_window_schedules_per_step():
    from omniroll.sampling.window import window_for_step as window

    def window_for_step(cfg, step):
        a, tc = cfg.algo, cfg.trainer
        return window(tc.window_schedule, step, cfg.pipeline.num_inference_steps, a.sde_window_size,
                      a.sde_window_range, tc.seed, tc.window_advance_every)

    base = {"reward": {"functions": {"c": {"fn": "prompt_colour"}}}, "n": 2,
            "pipeline": {"num_inference_steps": 10}, "algo": {"sde_window_size": 2, "sde_window_range": [0, 6]}}
    prog = load_config({**base, "trainer": {"prompts": ["a red car"], "prompts_per_step": 1,
                                            "window_schedule": "progressive", "window_advance_every": 2}})
    # MixGRPO's sliding window: one step every 2 iterations, shrinking at the range's end, then back to the start
    assert [window_for_step(prog, s) for s in range(1, 15)] == [(0, 2), (0, 2), (1, 3), (1, 3), (2, 4), (2, 4),
                                                                  (3, 5), (3, 5), (4, 6), (4, 6), (5, 6), (5, 6),
                                                                  (0, 2), (0, 2)]
    rnd = load_config({**base, "trainer": {"prompts": ["a red car"], "prompts_per_step": 1,
                                           "window_schedule": "random", "seed": 3}})
    wins = [window_for_step(rnd, s) for s in range(1, 30)]
    assert wins == [window_for_step(rnd, s) for s in range(1, 30)]  # a function of (seed, step): resumable
    assert all(0 <= a and b == a + 2 and b <= 6 for a, b in wins) and len(set(wins)) > 1
    fixed = load_config({**base, "trainer": {"prompts": ["a red car"], "prompts_per_step": 1}})
    assert window_for_step(fixed, 5) is None


def test_a_checkpoint_replaces_a_stale_one_whole(tiny_sd3_path, tmp_path):
    """A run written into the `--out` of an earlier run: its step directory replaces the old one whole (the old run's
    versions.safetensors, from an asynchronous run, once stayed beside a synchronous run's weights and broke
    `--resume` with a KeyError), and `latest` names only a complete checkpoint."""
    from omniroll.train.checkpoint import find_checkpoint, read_trainer_state, write_checkpoint
    from omniroll.train.policy import Policy
    from omniroll.train.version_store import VersionStore

    out = str(tmp_path / "run")
    pol = Policy(tiny_sd3_path, "lora", rank=4, alpha=8, seed=3)
    kept = VersionStore(pol, keep=1)  # an asynchronous run keeps versions
    kept.record(0)
    kept.record(1)
    state = {"step": 2, "version": 2, "optimizer": {}, "mode": "lora"}
    first = write_checkpoint(out, 2, policy=pol, store=kept, state=state)
    assert os.path.isfile(os.path.join(first, "versions.safetensors"))
    sync = VersionStore(pol, keep=0)  # a synchronous run in the same --out keeps none
    sync.record(2)
    second = write_checkpoint(out, 2, policy=pol, store=sync, state=state)
    assert second == first and find_checkpoint(out) == second
    assert find_checkpoint(os.path.join(out, "checkpoints", "latest")) == second  # the pointer file itself
    named_latest = write_checkpoint(str(tmp_path / "latest"), 2, policy=pol, store=sync, state=state)
    assert find_checkpoint(str(tmp_path / "latest")) == named_latest  # a run directory called "latest"
    with pytest.raises(FileNotFoundError, match="--checkpoint .*nor a checkpoints/latest file"):
        find_checkpoint(os.path.join(out, "checkpoints"), "--checkpoint")
    assert not os.path.exists(os.path.join(second, "versions.safetensors"))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000002"]  # no temporary left
    assert read_trainer_state(second)["step"] == 2


def test_a_checkpoint_that_fails_to_write_leaves_the_previous_one(tiny_sd3_path, tmp_path):
    from omniroll.train.checkpoint import find_checkpoint, write_checkpoint
    from omniroll.train.policy import Policy
    from omniroll.train.version_store import VersionStore

    out = str(tmp_path / "run")
    pol = Policy(tiny_sd3_path, "lora", rank=4, alpha=8, seed=3)
    store = VersionStore(pol, keep=0)
    good = write_checkpoint(out, 1, policy=pol, store=store, state={"step": 1, "version": 1, "optimizer": {},
                                                                    "mode": "lora"})
    import pickle

    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):  # a state torch cannot save: midway
        write_checkpoint(out, 2, policy=pol, store=store, state={"step": 2, "bad": lambda: 0})
    assert find_checkpoint(out) == good
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000001"]
