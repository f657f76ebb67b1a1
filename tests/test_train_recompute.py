"""The public recompute: with the rollout's weights it reproduces the engine's log-probs bitwise, with autograd on,
for every SDE type, CFG, any sub-batch; TrajectoryBatch carries the engine's execution mode."""

import pytest
import torch
from peft import LoraConfig

from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
from omniroll.models import load_adapter
from omniroll.train import TrajectoryBatch, recompute_log_probs
from omniroll.weights import WeightSender


@pytest.fixture(scope="module")
def engine_and_policy(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    policy = load_adapter(tiny_sd3_path)
    policy.denoiser.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in policy.denoiser.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    WeightSender([engine]).send(policy.denoiser, version=1)
    yield engine, policy
    engine.shutdown()


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_recompute_with_grad_equals_rollout_bitwise(engine_and_policy, sde_type):
    engine, policy = engine_and_policy
    sp = SamplingParams(height=32, width=32, num_inference_steps=5, guidance_scale=4.5, max_sequence_length=8,
                        noise_level=0.8, sde_type=sde_type, sde_window_size=2, sde_window_range=(0, 4))
    outs = engine.generate([GenerationRequest(request_id=f"r{i}", prompt=["a red car", "a blue bird"][i % 2], seed=i,
                                              sampling_params=sp) for i in range(5)])
    traj = TrajectoryBatch.from_outputs(outs)
    assert traj.execution == {"batch_invariant": True, "invariant_block_rows": 64, "dtype": "float32",
                              "merge_lora": False}
    assert traj.weight_version == [1] * 5
    lora = [p for n, p in policy.denoiser.named_parameters() if "lora_" in n]
    for k in range(traj.num_steps):
        for rows in ([0, 1, 2, 3, 4], [3], [4, 0]):
            out = recompute_log_probs(policy, traj.rows(rows), k)
            assert out.log_prob.requires_grad
            assert torch.equal(out.log_prob.detach(), traj.log_probs[rows, k]), (sde_type, k, rows)
    out.log_prob.sum().backward()
    assert all(p.grad is not None for p in lora) and any(p.grad.abs().sum() > 0 for p in lora)
    for p in lora:
        p.grad = None
    with pytest.raises(ValueError, match="step must be in"):
        recompute_log_probs(policy, traj, traj.num_steps)


def test_recompute_refuses_a_dtype_mismatch_merged_rollouts_and_rows_without_execution(engine_and_policy):
    engine, policy = engine_and_policy
    sp = SamplingParams(height=32, width=32, num_inference_steps=3, max_sequence_length=8, sde_window_size=1)
    outs = engine.generate([GenerationRequest(request_id="d", prompt="a cat", seed=1, sampling_params=sp)])
    traj = TrajectoryBatch.from_outputs(outs)
    traj.execution = {**traj.execution, "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="rollout ran in bfloat16"):
        recompute_log_probs(policy, traj, 0)
    traj.execution = {**traj.execution, "dtype": "float32", "merge_lora": True}  # engine.merge_lora: not bitwise
    with pytest.raises(ValueError, match="rolled out with engine.merge_lora"):
        recompute_log_probs(policy, traj, 0)
    del outs[0].extra_fields["execution"]
    with pytest.raises(ValueError, match="execution"):
        TrajectoryBatch.from_outputs(outs)


def test_gradient_checkpointing_in_the_mode_keeps_values_and_gradients_bitwise(engine_and_policy, tiny_sd3_path):
    from omniroll.train import enable_gradient_checkpointing

    engine, policy = engine_and_policy
    sp = SamplingParams(height=32, width=32, num_inference_steps=4, max_sequence_length=8, sde_window_size=2)
    traj = TrajectoryBatch.from_outputs(engine.generate(
        [GenerationRequest(request_id=f"g{i}", prompt="a blue car", seed=i, sampling_params=sp) for i in range(3)]))
    lora = [p for n, p in policy.denoiser.named_parameters() if "lora_" in n]

    def run():
        out = recompute_log_probs(policy, traj, 1)
        out.log_prob.sum().backward()
        grads = [p.grad.clone() for p in lora]
        for p in lora:
            p.grad = None
        return out.log_prob.detach(), grads

    plain, plain_grads = run()
    enable_gradient_checkpointing(policy.denoiser, traj.execution)
    try:
        ckpt, ckpt_grads = run()
    finally:
        policy.denoiser.disable_gradient_checkpointing()
    assert torch.equal(plain, traj.log_probs[:, 1]) and torch.equal(ckpt, plain)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, ckpt_grads))


def test_readme_custom_training_loop_runs_verbatim(tmp_path, monkeypatch):
    """The trainer page's "training loop of your own" block, executed as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "training" / "index.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "recompute_log_probs(policy" in b]
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "docs/training/index.md", "exec"), {"__name__": "__readme__"})


def test_rollout_and_recompute_run_one_guided_velocity_in_one_mode(engine_and_policy):
    """The bitwise promise rests on one function, not two copies: the engine's step and the recompute both enter
    `engine.execution.execution_mode` and reach the model only through `DiffusionAdapter.guided_velocity`."""
    from omniroll.engine import execution
    from omniroll.models.base import DiffusionAdapter
    from omniroll.train import recompute

    assert recompute.execution_mode is execution.execution_mode  # the recompute lives in train/recompute.py
    engine, policy = engine_and_policy
    calls = []
    for name, adapter in (("rollout", engine.adapter), ("recompute", policy)):
        assert type(adapter).guided_velocity is DiffusionAdapter.guided_velocity
        inside = []

        def guided(*args, _a=adapter, _in=inside, _n=name, **kwargs):
            _in.append(True)
            try:
                return type(_a).guided_velocity(_a, *args, **kwargs)
            finally:
                _in.pop()

        def velocity(*args, _a=adapter, _in=inside, _n=name, **kwargs):
            calls.append((_n, bool(_in), isinstance(torch.overrides._get_current_function_mode(),
                                                     execution.BatchInvariantMode)))
            return type(_a).velocity(_a, *args, **kwargs)

        adapter.guided_velocity, adapter.velocity = guided, velocity
    try:
        sp = SamplingParams(height=32, width=32, num_inference_steps=3, guidance_scale=4.5, max_sequence_length=8,
                            sde_window_size=1)
        traj = TrajectoryBatch.from_outputs(engine.generate(
            [GenerationRequest(request_id=f"v{i}", prompt="a red car", seed=i, sampling_params=sp) for i in range(2)]))
        assert torch.equal(recompute_log_probs(policy, traj, 0).log_prob.detach(), traj.log_probs[:, 0])
    finally:
        for adapter in (engine.adapter, policy):
            del adapter.guided_velocity, adapter.velocity
    assert {c[0] for c in calls} == {"rollout", "recompute"}
    assert all(inside and invariant_mode for _, inside, invariant_mode in calls), calls
