"""A weight update is a transaction: checked before anything is drained, values checked as they arrive, never a
sample from a partly updated model (tiny SD3 engine, real buckets, real PEFT adapters)."""

import asyncio
import threading
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine, EngineError
from omniroll.weights import WeightManifest, WeightSender, WeightSyncError, lora_state_dict, pack_buckets
from omniroll.weights.buckets import BucketEntry

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=4, max_sequence_length=16)


def req(rid="r", seed=3, steps=4):
    return GenerationRequest(request_id=rid, prompt="a photo of a dog", seed=seed,
                             sampling_params=PARAMS.model_copy(update={"num_inference_steps": steps}))


def target_weights(engine, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in engine.adapter.denoiser.state_dict().items()}


def same(a, b):
    assert a.stop_reason == b.stop_reason == "completed"
    assert torch.equal(a.diffusion_output, b.diffusion_output) and torch.equal(a.log_probs, b.log_probs)


def update(engine, weights, version, buckets=None):
    named = list(weights.items())
    return engine.update_weights_from_ipc(manifest=WeightManifest.from_named_tensors(named),
                                          buckets=buckets if buckets is not None else pack_buckets(named, 64 << 10),
                                          version=version)


def ends_early(named):
    return list(pack_buckets(named, 64 << 10))[:-1]


def disagrees_with_manifest(named):
    buckets = list(pack_buckets(named, 64 << 10))
    e = buckets[2].entries[0]
    buckets[2].entries[0] = BucketEntry(e.name, e.dtype, (e.nbytes // 4,), e.offset, e.nbytes)  # flat, not e.shape
    return buckets


def sender_raises(named):
    for i, b in enumerate(pack_buckets(named, 64 << 10)):
        if i == 3:
            raise RuntimeError("trainer died mid-stream")
        yield b


@pytest.fixture(scope="module")
def snapshot_engine(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_mid_stream_faults_then_a_good_update_gives_bitwise_expected_samples(tiny_sd3_path, mode):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, weight_update=mode)
    before = eng.generate([req()])[0]
    base = {k: v.clone() for k, v in eng.adapter.denoiser.state_dict().items()}
    target = target_weights(eng, 1)
    named = list(target.items())
    for fault, match in ((ends_early, "never received"), (disagrees_with_manifest, "inconsistent with the manifest"),
                         (sender_raises, "trainer died")):
        with pytest.raises((WeightSyncError, RuntimeError), match=match):
            update(eng, target, 5, fault(named))
        assert eng.weight_version == 0
        if mode == "staged":  # the model was never touched and keeps serving
            assert all(torch.equal(base[k], v) for k, v in eng.adapter.denoiser.state_dict().items())
            same(before, eng.generate([req()])[0])
        else:  # partly written: every request is refused, naming the failed version, until a complete update
            with pytest.raises(EngineError, match="version 5 failed midway"):
                eng.generate([req()])
    ack = update(eng, target, 5)  # the failed version may be retried: nothing landed under it
    assert ack["version"] == 5 and eng.weight_version == 5
    after = eng.generate([req()])[0]
    ref = DiffusionEngine.from_pretrained(tiny_sd3_path)  # loaded with the target weights, not through an update
    ref.adapter.denoiser.load_state_dict(target)
    same(ref.generate([req()])[0], after)
    assert after.weight_version == 5 and not torch.equal(after.diffusion_output, before.diffusion_output)
    ref.shutdown()
    eng.shutdown()


def test_in_place_failure_fails_the_waiting_requests_naming_the_version(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, weight_update="in_place")
    target = target_weights(eng, 2)
    results = []

    def submit():
        try:
            results.append(eng.generate([req("w")]))
        except EngineError as e:
            results.append(e)

    def arrives_mid_stream(named):  # a request arrives while the update streams, then the sender dies
        for i, b in enumerate(pack_buckets(named, 64 << 10)):
            if i == 3:
                waiter = threading.Thread(target=submit)
                waiter.start()
                while eng.stats()["waiting"] == 0:
                    time.sleep(0.005)
                raise RuntimeError("trainer died mid-stream")
            yield b

    with pytest.raises(RuntimeError, match="trainer died"):
        update(eng, target, 3, arrives_mid_stream(list(target.items())))
    while not results:
        time.sleep(0.01)
    assert isinstance(results[0], EngineError) and "request w" in str(results[0])
    assert "version 3 failed midway" in str(results[0])
    update(eng, target, 3)
    assert eng.generate([req("w")])[0].weight_version == 3
    eng.shutdown()


def test_rejected_update_aborts_nothing_and_changes_nothing(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    good = target_weights(eng, 4)
    bad_name = dict(good, **{"transformer_blocks.0.attn.not_a_param": torch.zeros(2)})
    bad_shape = dict(good, **{"proj_out.bias": torch.zeros(3)})

    async def run():
        task = asyncio.create_task(eng.generate_async(req("long", steps=40)))
        while eng.stats()["steps"] == 0:
            await asyncio.sleep(0.01)
        errors = []
        for weights, version in ((bad_name, 1), (bad_shape, 1), (good, 0), (good, 2.9), (good, "v2"), (good, None),
                                 (good, True)):
            with pytest.raises(WeightSyncError) as e:
                await asyncio.to_thread(update, eng, weights, version)
            errors.append(str(e.value))
        return await task, errors

    out, errors = asyncio.run(run())
    assert out.stop_reason == "completed" and out.weight_version == 0  # never aborted, never saw other weights
    assert "not_a_param" in errors[0] and "proj_out.bias" in errors[1] and "> the current weight version 0" in errors[2]
    assert all("must be an int" in e for e in errors[3:])
    assert eng.weight_version == 0
    eng.shutdown()


def test_versions_never_go_backwards_and_a_landed_version_is_not_reapplied(snapshot_engine):
    eng = snapshot_engine
    weights = {k: v.clone() for k, v in eng.adapter.denoiser.state_dict().items()}
    update(eng, weights, 7)
    for version in (3, 7):
        with pytest.raises(WeightSyncError, match="> the current weight version 7"):
            update(eng, weights, version)
    with pytest.raises(WeightSyncError, match="> the current weight version 7"):
        eng.remove_lora(version=6)
    assert update(eng, weights, 8)["version"] == 8 and eng.weight_version == 8
    assert eng.set_weight_version(8) == {"version": 8} and eng.set_weight_version(9) == {"version": 9}
    with pytest.raises(WeightSyncError, match="> the current weight version 9"):
        eng.set_weight_version(2)
    with pytest.raises(AttributeError, match="set_weight_version"):
        eng.weight_version = 10
    assert eng.generate([req("v")])[0].weight_version == 9


def test_non_finite_full_update_is_rejected_naming_the_tensor(snapshot_engine):
    eng = snapshot_engine
    before = eng.generate([req("nan")])[0]
    version = eng.weight_version
    for bad_value in (float("nan"), float("inf")):
        weights = target_weights(eng, 5)
        weights["transformer_blocks.1.attn.to_k.weight"][0, 3] = bad_value
        with pytest.raises(WeightSyncError, match=r"non-finite.*transformer_blocks\.1\.attn\.to_k\.weight"):
            update(eng, weights, version + 1)
    assert eng.weight_version == version
    same(before, eng.generate([req("nan")])[0])


def test_non_finite_lora_update_is_rejected_and_keeps_the_previous_adapter(snapshot_engine):
    eng = snapshot_engine
    from diffusers import SD3Transformer2DModel

    module = SD3Transformer2DModel.from_config(eng.adapter.denoiser.config)
    module.load_state_dict(eng.adapter.denoiser.state_dict())
    wrapped = get_peft_model(module, LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"],
                                                init_lora_weights=False))
    WeightSender([eng]).send(wrapped, version=eng.weight_version + 1)
    with_lora, lora_name = eng.generate([req("lora")])[0], eng.stats()["lora"]
    version = eng.weight_version
    config = wrapped.peft_config["default"].to_dict()
    for bad_value in (float("inf"), float("nan")):
        tensors = {k: v.clone() for k, v in lora_state_dict(wrapped).items()}
        tensors["transformer_blocks.0.attn.to_v.lora_B.weight"][1, 0] = bad_value
        with pytest.raises(WeightSyncError, match=r"non-finite.*transformer_blocks\.0\.attn\.to_v\.lora_B\.weight"):
            WeightSender([eng]).send(tensors, version=version + 1, peft_config=config)
    wrong_rank = {k: (v[:2] if ".lora_A." in k else v) for k, v in lora_state_dict(wrapped).items()}
    with pytest.raises(WeightSyncError, match="rank"):  # checked from the manifest, before anything is read
        WeightSender([eng]).send(wrong_rank, version=version + 1, peft_config=config)
    assert eng.weight_version == version and eng.stats()["lora"] == lora_name is not None
    same(with_lora, eng.generate([req("lora")])[0])
    eng.remove_lora(version=version + 1)


def test_after_sleep_2_an_update_lands_in_place_and_a_failed_one_keeps_refusing(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)  # staged by default
    target = target_weights(eng, 6)
    eng.sleep(level=2)
    eng.wake_up()
    with pytest.raises(RuntimeError, match="trainer died"):
        update(eng, target, 1, sender_raises(list(target.items())))
    with pytest.raises(EngineError, match="version 1 failed midway"):
        eng.generate([req()])
    update(eng, target, 1)
    ref = DiffusionEngine.from_pretrained(tiny_sd3_path)
    ref.adapter.denoiser.load_state_dict(target)
    same(ref.generate([req()])[0], eng.generate([req()])[0])
    ref.shutdown()
    eng.shutdown()
