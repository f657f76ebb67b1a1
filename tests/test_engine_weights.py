"""Weight sync, versions, and sleep / wake on the engine (tiny SD3, CPU)."""

import asyncio
import shutil
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.lifecycle import EngineAsleepError
from omniroll.weights import WeightSender, WeightSyncError, lora_state_dict

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=4, max_sequence_length=16)


def req(rid, seed):
    return GenerationRequest(request_id=rid, prompt="a photo of a dog", seed=seed, sampling_params=PARAMS)


def perturbed(engine, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in engine.adapter.denoiser.state_dict().items()}


def same(a, b):
    assert a.stop_reason == b.stop_reason == "completed"
    assert torch.equal(a.diffusion_output, b.diffusion_output)
    assert torch.equal(a.log_probs, b.log_probs)


@pytest.fixture(scope="module")
def engine(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def perturbed_checkpoint(tiny_sd3_path, tmp_path_factory, engine):
    """A second checkpoint directory whose transformer holds perturbed weights (version 1)."""
    path = tmp_path_factory.mktemp("perturbed") / "ckpt"
    shutil.copytree(tiny_sd3_path, path)
    weights = perturbed(engine, 1)
    fresh = DiffusionEngine.from_pretrained(tiny_sd3_path)
    fresh.adapter.denoiser.load_state_dict(weights)
    fresh.adapter.denoiser.save_pretrained(str(path / "transformer"))
    fresh.shutdown()
    return str(path), weights


def test_full_sync_equals_fresh_engine_with_those_weights(tiny_sd3_path, perturbed_checkpoint):
    path, weights = perturbed_checkpoint
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    before = eng.generate([req("a", 5)])[0]
    acks = WeightSender([eng], bucket_bytes=64 << 10).send(weights, version=1)
    assert acks[0]["mode"] == "full" and acks[0]["num_buckets"] > 1 and acks[0]["version"] == 1
    after = eng.generate([req("a", 5)])[0]
    ref_engine = DiffusionEngine.from_pretrained(path)
    ref = ref_engine.generate([req("a", 5)])[0]
    same(after, ref)
    assert not torch.equal(before.diffusion_output, after.diffusion_output)
    assert before.weight_version == 0 and after.weight_version == 1
    eng.shutdown()
    ref_engine.shutdown()


def test_mismatched_names_raise_and_leave_the_model_unchanged(engine):
    snapshot = {k: v.clone() for k, v in engine.adapter.denoiser.state_dict().items()}
    before = engine.generate([req("m", 1)])[0]
    bad = perturbed(engine, 2)
    bad["transformer_blocks.0.attn.to_q.not_a_param"] = torch.zeros(3)
    del bad["proj_out.bias"]
    with pytest.raises(WeightSyncError, match="not_a_param") as err:
        WeightSender([engine]).send(bad, version=9)
    assert "proj_out.bias" in str(err.value)
    assert all(torch.equal(snapshot[k], v) for k, v in engine.adapter.denoiser.state_dict().items())
    assert engine.weight_version == 0
    same(before, engine.generate([req("m", 1)])[0])


def test_lora_sync_equals_peft_model_and_removal_restores_base(engine):
    base_out = engine.generate([req("l", 3)])[0]
    wrapped = get_peft_model(_copy_transformer(engine), LoraConfig(r=4, lora_alpha=8,
                             target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False))
    acks = WeightSender([engine]).send(wrapped, version=2)
    assert acks[0]["mode"] == "lora" and acks[0]["num_tensors"] == len(lora_state_dict(wrapped))
    x = torch.randn(2, 16, 8, 8)
    inputs = dict(hidden_states=x, timestep=torch.tensor([500.0, 250.0]),
                  encoder_hidden_states=torch.randn(2, 93, 32), pooled_projections=torch.randn(2, 64))
    with torch.no_grad():
        ours = engine.adapter.denoiser(**inputs).sample
        theirs = wrapped(**inputs).sample
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-6)
    lora_out = engine.generate([req("l", 3)])[0]
    assert lora_out.weight_version == 2 and not torch.equal(lora_out.diffusion_output, base_out.diffusion_output)
    engine.remove_lora(version=3)
    same(base_out, engine.generate([req("l", 3)])[0])


def _copy_transformer(engine):
    from diffusers import SD3Transformer2DModel

    module = SD3Transformer2DModel.from_config(engine.adapter.denoiser.config)
    module.load_state_dict(engine.adapter.denoiser.state_dict())
    return module.eval()


def test_no_mixed_versions_under_concurrent_updates(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    versions = {0: {k: v.clone() for k, v in eng.adapter.denoiser.state_dict().items()},
                1: perturbed(eng, 11), 2: perturbed(eng, 12)}
    reqs = [GenerationRequest(request_id=f"c{i}", prompt="a photo of a dog", seed=100 + i,
                              sampling_params=PARAMS.model_copy(update={"num_inference_steps": 6 + i % 3}))
            for i in range(10)]

    async def run():
        async def until_done(r):
            while True:
                out = await eng.generate_async(r)
                if out.stop_reason == "completed":
                    return out
                assert out.stop_reason == "aborted"

        async def until_running():
            deadline = time.monotonic() + 30
            while eng.stats()["running"] == 0:
                assert time.monotonic() < deadline, "no request started within 30 s"
                await asyncio.sleep(0.002)

        tasks = [asyncio.create_task(until_done(r)) for r in reqs[:8]]
        await until_running()  # the first update finds samples in flight: they finish on version 0
        await asyncio.to_thread(WeightSender([eng]).send, versions[1], 1)
        await asyncio.sleep(0.02)
        await asyncio.to_thread(WeightSender([eng]).send, versions[2], 2)
        tasks += [asyncio.create_task(until_done(r)) for r in reqs[8:]]  # submitted after the last update
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    eng.shutdown()
    seen = {o.weight_version for o in outs}
    assert seen <= {0, 1, 2} and {0, 2} <= seen, seen
    assert all(o.weight_version == 2 for o in outs[8:])
    check = DiffusionEngine.from_pretrained(tiny_sd3_path)
    for v in sorted(seen):
        if v:  # version 0 is the checkpoint the engine was loaded with
            WeightSender([check]).send(versions[v], version=v)
        for r, o in zip(reqs, outs):
            if o.weight_version == v:
                same(o, check.generate([r])[0])
    check.shutdown()


def test_sleep_wake_round_trip(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    before = eng.generate([req("s", 8)])[0]
    weights = {k: v.clone() for k, v in eng.adapter.denoiser.state_dict().items()}
    eng.sleep(level=1)
    with pytest.raises(EngineAsleepError, match="asleep"):
        eng.generate([req("s", 8)])
    eng.wake_up()
    same(before, eng.generate([req("s", 8)])[0])
    eng.sleep(level=2)
    assert all(p.is_meta for p in eng.adapter.denoiser.parameters())
    eng.wake_up()
    with pytest.raises(EngineAsleepError, match="weight sync"):
        eng.generate([req("s", 8)])
    WeightSender([eng]).send(weights, version=4)
    after = eng.generate([req("s", 8)])[0]
    same(before, after)
    assert after.weight_version == 4
    eng.shutdown()


def test_wait_policy_holds_requests_until_wake(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, asleep_policy="wait")
    ref = eng.generate([req("w", 2)])[0]
    eng.sleep(level=1)

    async def run():
        task = asyncio.create_task(eng.generate_async(req("w", 2)))
        await asyncio.sleep(0.2)
        assert not task.done()
        await asyncio.to_thread(eng.wake_up)
        return await task

    same(ref, asyncio.run(run()))
    eng.shutdown()


def test_wake_failure_and_hang_reach_the_caller(tiny_sd3_path, monkeypatch):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    eng.sleep(level=1)
    vae = eng.adapter.vae

    def oom(*args, **kwargs):  # stands in for a CUDA OOM, which cannot happen on this CPU machine
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(vae, "to", oom)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="out of memory"):
        eng.wake_up(timeout_s=5)
    assert time.monotonic() - t0 < 5

    def hang(*args, **kwargs):
        time.sleep(3)
        return vae

    monkeypatch.setattr(vae, "to", hang)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        eng.wake_up(timeout_s=0.5)
    assert time.monotonic() - t0 < 2
    monkeypatch.undo()
    time.sleep(3)
    eng.wake_up()
    assert eng.generate([req("x", 1)])[0].stop_reason == "completed"
    eng.shutdown()


@pytest.mark.parametrize("transport", ["shm", pytest.param("ray", marks=pytest.mark.slow)])  # ray: starts it
def test_sync_through_shm_and_object_refs(tiny_sd3_path, perturbed_checkpoint, transport, request):
    if transport == "ray":
        request.getfixturevalue("ray_cluster")
    path, weights = perturbed_checkpoint
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    acks = WeightSender([eng], bucket_bytes=128 << 10, transport=transport).send(weights, version=7)
    assert acks[0]["version"] == 7 and acks[0]["num_buckets"] > 1
    ref_engine = DiffusionEngine.from_pretrained(path)
    same(ref_engine.generate([req("t", 4)])[0], eng.generate([req("t", 4)])[0])
    ref_engine.shutdown()
    eng.shutdown()
