"""The trainer on its device, on the CPU through the same code: `trainer.device` / `trainer.dtype` and what
they refuse (naming the key, before anything starts), the compute dtype (the frozen base in it, trainable weights,
optimizer state and log-probs in fp32), colocated replicas asleep around every update (samples, log-probs and
ratios bitwise what they are without colocation), and the peak memory per stage where the device reports it. A GPU
is mocked only where one must exist (`torch.cuda`'s answers)."""

import json

import pytest
import torch

from omniroll.config import ConfigError, load_config
from omniroll.train import Trainer

PROMPTS = ["a blue car", "a green bird", "a green car", "a blue bird"]


def train_config(model, replicas=None, engine=None, **trainer):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1, **(replicas or {})},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1, **(engine or {})},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5,
                     "max_sequence_length": 8},
        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 1}, "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"}}},
        "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"prompts": PROMPTS, "prompts_per_step": 2, "lr": 0.01, "micro_batch_size": 4, "steps": 2,
                    "num_threads": 1, "num_inner_epochs": 2, "policy_move_rows": 2, **trainer},
    })


@pytest.mark.parametrize("overrides,message", [
    ({"device": "mps"}, r"trainer\.device: must be cpu, cuda or cuda:N, got 'mps'"),
    ({"dtype": "bfloat16"}, r"trainer\.dtype: must be engine\.dtype=float32"),
    ({"world_size": 2, "device": "cuda"}, r"trainer\.resources\.num_gpus: a rank on cuda reserves its GPU: must be 1"),
    ({"world_size": 2, "device": "cuda:1", "resources": {"num_gpus": 1}},
     r"trainer\.device: with world_size > 1 every rank uses the GPU Ray reserved for it: cuda"),
    ({"world_size": 2, "resources": {"num_gpus": 1}}, r"trainer\.resources\.num_gpus: a rank on the CPU .* must be 0"),
    ({"sharding": "fsdp"}, r"trainer\.sharding: fsdp needs trainer\.mode full \(got lora\), trainer\.world_size > 1"),
    ({"sharding": "fsdp", "mode": "full", "world_size": 2, "max_staleness": 1},
     r"trainer\.sharding: fsdp needs trainer\.max_staleness 0 \(got 1\)"),
])
def test_device_keys_are_refused_naming_the_key(tiny_sd3_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train_config(tiny_sd3_path, **overrides)


def test_colocation_keys_are_refused_naming_the_key(tiny_sd3_path):
    with pytest.raises(ConfigError, match=r"replicas\.colocate: .* needs trainer\.max_staleness 0, got 1"):
        train_config(tiny_sd3_path, replicas={"colocate": True}, max_staleness=1)
    with pytest.raises(ConfigError, match=r"replicas\.sleep_level: 2 drops .* needs trainer\.mode full, got lora"):
        train_config(tiny_sd3_path, replicas={"colocate": True, "sleep_level": 2})
    with pytest.raises(ConfigError, match=r"replicas\.colocate: supported with trainer\.world_size 1"):
        train_config(tiny_sd3_path, replicas={"colocate": True}, world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_where_there_is_none_is_refused_before_anything_starts(tiny_sd3_path, tmp_path):
    import ray

    was = ray.is_initialized()
    cfg = train_config(tiny_sd3_path, device="cuda")  # valid as a config: the machine decides
    with pytest.raises(ValueError, match=r"trainer\.device: cuda asked, but torch sees no CUDA device here"):
        Trainer(cfg, str(tmp_path / "run"), log=lambda s: None).start()
    assert ray.is_initialized() == was and not (tmp_path / "run").exists()


def test_a_dtype_the_gpu_cannot_run_is_refused(monkeypatch):
    """A (mocked) pre-Ampere GPU: bf16 refused naming trainer.dtype; cuda:N past the device count naming the device."""
    from omniroll.config.device import check_device_here

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Tesla V100")
    with pytest.raises(ValueError, match=r"trainer\.dtype: bfloat16 is not supported by Tesla V100"):
        check_device_here("cuda", "bfloat16")
    with pytest.raises(ValueError, match=r"trainer\.device: cuda:1 asked, but this machine has 1 CUDA device"):
        check_device_here("cuda:1", "float32")
    check_device_here("cuda:0", "float16")  # fine


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bf16_policy_keeps_fp32_weights_optimizer_state_and_log_probs(tiny_sd3_path, mode):
    """trainer.dtype bfloat16: the frozen base in bf16 (LoRA), trained weights in fp32 (full: master weights, computed
    under autocast), log-probs in fp32, AdamW's moments in fp32; the first recompute is the bf16 rollout's, bitwise."""
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
    from omniroll.train import Policy, TrajectoryBatch, recompute_log_probs

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, dtype=torch.bfloat16, max_batch_size=8)
    try:
        sp = SamplingParams(height=32, width=32, num_inference_steps=4, max_sequence_length=8, sde_window_size=2,
                            noise_level=1.0, guidance_scale=4.5)
        traj = TrajectoryBatch.from_outputs(engine.generate([GenerationRequest(
            request_id="r", prompt="a blue car", seed=3, sampling_params=sp)]))
    finally:
        engine.shutdown()
    policy = Policy(tiny_sd3_path, mode, dtype="bfloat16")
    assert policy.adapter.compute_dtype == torch.bfloat16
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    frozen = {p.dtype for p in policy.denoiser.parameters() if not p.requires_grad}
    assert frozen == ({torch.bfloat16} if mode == "lora" else set())
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    out = recompute_log_probs(policy.adapter, traj.to(policy.device), 0)
    assert out.log_prob.dtype == torch.float32 and torch.equal(out.log_prob.detach(), traj.log_probs[:, 0])
    out.log_prob.sum().backward()
    opt.step()
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}


class RecordingTrainer(Trainer):
    """A trainer that keeps every rollout it trains on."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rollouts = []

    async def _rollout(self, step):
        out = await super()._rollout(step)
        self.rollouts.append(out)
        return out


TIMINGS = {"rollout_s", "reward_wait_s", "rollout_wait_s", "train_s", "recompute_s", "sync_s", "step_s",
           "policy_move_s", "samples_per_s", "overlap_frac", "sleep_s", "wake_s"}


def run_recorded(cfg, out):
    lines = []
    with RecordingTrainer(cfg, out, log=lines.append) as tr:
        hist = tr.train()
        weights = {k: p.detach().clone() for k, p in tr.policy.named_parameters()}
        return hist, tr.rollouts, weights, lines


@pytest.mark.parametrize("mode,level", [("lora", 1), ("full", 2)])
def test_colocated_replicas_sleep_around_every_update_and_change_nothing(ray_cluster, tiny_sd3_path, tmp_path, mode,
                                                                        level):
    """replicas.colocate: the replica sleeps (level 1: offloaded; level 2: its denoiser dropped, restored by the full
    sync) before every update and wakes before the sync. Every sample, recorded log-prob and metric is bitwise what
    the same run gives without colocation, and so are the trained weights; the step line shows sleep and wake."""
    base, colo = (train_config(tiny_sd3_path, mode=mode, replicas=r)
                  for r in ({}, {"colocate": True, "sleep_level": level}))
    h0, r0, w0, _ = run_recorded(base, str(tmp_path / "separate"))
    h1, r1, w1, lines = run_recorded(colo, str(tmp_path / "colocated"))
    assert len(r0) == len(r1) == 2
    for a, b in zip(r0, r1):  # the rollouts: pixels, latents, log-probs
        for k in ("responses", "all_latents", "rollout_log_probs", "rm_scores"):
            assert torch.equal(a.batch[k], b.batch[k]), k
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    for m0, m1 in zip(h0, h1):
        assert {k: v for k, v in m0.items() if k not in TIMINGS} == {k: v for k, v in m1.items() if k not in TIMINGS}
        assert m1["ratio_max_abs_dev"] == 0.0 and m1["sleep_s"] > 0 and m1["wake_s"] > 0 and "sleep_s" not in m0
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(" sleep " in line and " wake " in line for line in steps), steps
    assert json.loads(open(tmp_path / "colocated" / "metrics.jsonl").readlines()[-1])["sleep_s"] > 0


def test_peak_memory_per_stage_where_the_device_reports_it(monkeypatch):
    """The CPU reports no memory: no peak_mem_* keys. A (mocked) GPU: the peak of each stage, the replicas' rollout
    peak and a rank's update peak folded in, in GiB, and the step line shows them."""
    from omniroll.train.report.stage_memory import StageMemory
    from omniroll.train.report.tracking import format_step, tracker_name

    cpu = StageMemory("cpu")
    cpu.begin()
    cpu.end("update")
    assert cpu.metrics() == {}
    allocated = iter([0, 3 << 30, 5 << 30, 1 << 30])  # the readings: begin, recompute, update, sync
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    gpu = StageMemory("cuda:0")
    gpu.begin()
    for stage in ("recompute", "update", "sync"):
        gpu.end(stage)
    gpu.add("rollout", 7 << 30)
    gpu.add("update", 4 << 30)  # a smaller peak elsewhere: the largest counts
    m = gpu.metrics()
    assert m == {"peak_mem_rollout_gb": 7.0, "peak_mem_recompute_gb": 3.0, "peak_mem_update_gb": 5.0,
                 "peak_mem_sync_gb": 1.0} and gpu.metrics() == {}
    record = {"step": 1, "reward_mean": 0.5, "reward_std": 0.1, "ratio_max_abs_dev": 2e-5, "clip_frac": 0.0,
              "approx_kl": 0.0, "kl": 0.0, "loss": 0.0, "grad_norm": 1.0, "weight_version": 0, "rollout_s": 1.0,
              "reward_wait_s": 0.0, "train_s": 1.0, "sync_s": 0.1, "step_s": 2.5, "sleep_s": 0.2, "wake_s": 0.3, **m}
    line = format_step(record, 10)
    assert "sleep 0.20s  wake 0.30s  mem rollout 7.0 recompute 3.0 update 5.0 sync 1.0 GiB" in line, line
    assert tracker_name("peak_mem_update_gb") == "perf/peak_mem_update_gb" and tracker_name("wake_s") == "timing/wake_s"


def test_out_of_memory_names_the_stage_and_what_to_change():
    """A device out of memory in the trainer's process: one error naming the stage in progress and its keys."""
    from omniroll.train.report.stage_memory import StageMemory, StageOutOfMemory

    mem = StageMemory("cpu")
    mem.begin()
    mem.end("recompute")  # the update is in progress now
    with pytest.raises(StageOutOfMemory, match=r"out of memory on cpu during the update stage: lower "
                                               r"trainer\.micro_batch_size.*Out of memory; torch: CUDA out of mem"):
        with mem.naming_oom():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    mem.end("update")
    mem.end("sync")
    assert mem.current == "recompute"  # the next step's
