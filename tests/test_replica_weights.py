"""Weight sync and sleep / wake through Ray replicas: object refs, /dev/shm, LoRA, updates under load."""

import asyncio
import os

import pytest
import ray
import torch
from peft import LoraConfig, get_peft_model

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine
from omniroll.rollout import RolloutClient, create_replicas, kill_replicas, output_from_wire
from omniroll.weights import WeightSender, leftover_shm
from omniroll.weights.transport import SHM_PREFIX

#: the shared-memory files this process's senders name (the sender runs here; a segment's name carries its pid)
OWN_SHM = f"{SHM_PREFIX}{os.getpid()}-"

SP = dict(height=64, width=64, num_inference_steps=4, max_sequence_length=16, guidance_scale=4.5)


@pytest.fixture(scope="module")
def setup(ray_cluster, tiny_sd3_path):
    handles = create_replicas(2, tiny_sd3_path, {"max_batch_size": 8, "num_threads": torch.get_num_threads()},
                              num_cpus=0)  # same threads as the in-process reference: same CPU kernels
    local = DiffusionEngine.from_pretrained(tiny_sd3_path)  # in-process reference engine
    base = {k: v.clone() for k, v in local.adapter.denoiser.state_dict().items()}
    yield handles, local, base
    local.shutdown()
    kill_replicas(handles)


def weights(base, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def load(local, sd):
    """Give the in-process reference engine these weights (its own versions only go up)."""
    WeightSender([local]).send(sd, version=local.weight_version + 1)


def reference(local, sd, rid, seed):
    load(local, sd)
    return local.generate([GenerationRequest(request_id=rid, prompt="a red car", seed=seed,
                                             sampling_params=SamplingParams(**SP))])[0]


def gen(handle, rid, seed):
    req = {"request_id": rid, "prompt": "a red car", "seed": seed, "sampling_params": SP}
    return output_from_wire(ray.get(handle.generate.remote(req)))


@pytest.mark.parametrize("transport,version", [("ray", 1), ("shm", 2)])
def test_full_sync_to_every_replica(setup, transport, version):
    handles, local, base = setup
    sd = weights(base, version)
    acks = WeightSender(handles, bucket_bytes=128 << 10, transport=transport).send(sd, version=version)
    assert sorted(a["replica_index"] for a in acks) == [0, 1]
    assert all(a["version"] == version and a["mode"] == "full" and a["num_buckets"] > 1 for a in acks)
    ref = reference(local, sd, "f", 3)
    for h in handles:
        out = gen(h, "f", 3)
        assert out.weight_version == version
        assert torch.equal(out.diffusion_output, ref.diffusion_output) and torch.equal(out.log_probs, ref.log_probs)
    assert leftover_shm(OWN_SHM) == []  # this process's segments: the other test worker may be mid-sync


def test_lora_sync_sends_only_lora_tensors(setup):
    handles, local, base = setup
    WeightSender(handles, transport="ray").send(base, version=10)
    plain = gen(handles[0], "l", 4)
    from diffusers import SD3Transformer2DModel

    module = SD3Transformer2DModel.from_config(local.adapter.denoiser.config)
    module.load_state_dict(base)
    wrapped = get_peft_model(module, LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"],
                                                init_lora_weights=False))
    acks = WeightSender(handles, transport="ray").send(wrapped, version=11)
    n_lora = sum(1 for k in wrapped.state_dict() if "lora_" in k)
    assert all(a["mode"] == "lora" and a["num_tensors"] == n_lora for a in acks)
    lora_out = gen(handles[1], "l", 4)
    assert lora_out.weight_version == 11 and not torch.equal(lora_out.diffusion_output, plain.diffusion_output)
    ray.get([h.remove_lora.remote(version=12) for h in handles])
    again = gen(handles[1], "l", 4)
    assert torch.equal(again.diffusion_output, plain.diffusion_output) and again.weight_version == 12


def test_update_under_load_client_reruns_aborted_with_same_seed(setup):
    handles, local, base = setup
    WeightSender(handles, transport="ray").send(base, version=20)
    new = weights(base, 21)

    async def go():
        client = RolloutClient(handles, timeout_s=120)
        sp = {**SP, "num_inference_steps": 8}
        tasks = [asyncio.create_task(client.generate(f"u{i}", "a red car", sp, seed=50 + i, group_id=f"grp{i % 2}"))
                 for i in range(8)]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(WeightSender(handles, transport="ray").send, new, 21)
        return await asyncio.gather(*tasks)

    outs = asyncio.run(go())
    assert all(o.stop_reason == "completed" for o in outs)
    by_version = {20: base, 21: new}
    assert {o.weight_version for o in outs} <= {20, 21}
    for i, o in enumerate(outs):
        load(local, by_version[o.weight_version])
        ref = local.generate([GenerationRequest(request_id=f"u{i}", prompt="a red car", seed=50 + i,
                                                sampling_params=SamplingParams(**{**SP, "num_inference_steps": 8}))])[0]
        assert torch.equal(o.diffusion_output, ref.diffusion_output), i


def test_replica_sleep_wake(setup):
    handles, _, base = setup
    WeightSender(handles[:1], transport="ray").send(base, version=30)
    before = gen(handles[0], "s", 9)
    ray.get(handles[0].sleep.remote(level=1))
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        gen(handles[0], "s", 9)
    assert ray.get(handles[0].stats.remote())["asleep_level"] == 1
    ray.get(handles[0].wake_up.remote())
    assert torch.equal(gen(handles[0], "s", 9).diffusion_output, before.diffusion_output)


def test_replica_update_faults_change_nothing_then_a_good_update_lands(setup):
    """Through Ray: a stream that ends early, a bucket that disagrees with the manifest, a shm sender that dies after
    some buckets, a NaN, a version going backwards: each is refused, the replica keeps serving its weights and
    version; then a good update gives the samples of an engine loaded with those weights, bitwise."""
    from omniroll.weights import RayBucketRef, ShmChannel, WeightManifest, pack_buckets, plan_buckets
    from omniroll.weights.buckets import BucketEntry

    handles, local, base = setup
    h = handles[0]
    WeightSender([h], transport="ray").send(base, version=40)
    before = gen(h, "x", 6)
    target = weights(base, 41)
    named = list(target.items())
    manifest = WeightManifest.from_named_tensors(named)
    refs = [RayBucketRef(ray.put(b.buffer), b.entries, b.index) for b in pack_buckets(named, 64 << 10)]
    e = refs[1].entries[0]
    wrong = [RayBucketRef(r.ref, [BucketEntry(e.name, e.dtype, (1, e.nbytes // 4), e.offset, e.nbytes)]
                          + r.entries[1:], r.index) if i == 1 else r for i, r in enumerate(refs)]
    nan = dict(target, **{"proj_out.weight": target["proj_out.weight"].clone().fill_(float("nan"))})

    def call(buckets, version=41, use_shm=False, m=manifest):
        return h.update_weights_from_ipc.remote(manifest=m, buckets=buckets, version=version, use_shm=use_shm)

    for remote, match in ((call(refs[:-1]), "never received"), (call(wrong), "inconsistent with the manifest"),
                          (call(refs, version=39), "> the current weight version 40"),
                          (call(refs, version=41.0), "must be an int")):
        with pytest.raises(ray.exceptions.RayTaskError, match=match):
            ray.get(remote, timeout=120)
    with pytest.raises(ray.exceptions.RayTaskError, match="non-finite.*proj_out.weight"):
        WeightSender([h], transport="ray").send(nan, version=41)
    plan = plan_buckets(manifest, 64 << 10)  # shm: the sender dies after 3 of its buckets
    chan = ShmChannel(plan, 1, timeout_s=60)
    try:
        pending = call(chan.descriptor(0), use_shm=True)
        chan.plan = plan[:3]
        chan.stream(iter(named))
        chan.abort()
        with pytest.raises(ray.exceptions.RayTaskError, match="sender aborted"):
            ray.get(pending, timeout=120)
    finally:
        chan.close()
    st = ray.get(h.stats.remote())
    assert st["weight_version"] == 40 and st["running"] == 0
    again = gen(h, "x", 6)
    assert again.weight_version == 40 and torch.equal(again.diffusion_output, before.diffusion_output)
    WeightSender([h], transport="ray").send(target, version=41)
    ref = reference(local, target, "x", 6)
    out = gen(h, "x", 6)
    assert out.weight_version == 41 and torch.equal(out.diffusion_output, ref.diffusion_output)
    assert torch.equal(out.log_probs, ref.log_probs) and leftover_shm(OWN_SHM) == []


def test_shut_down_replica_refuses_every_call_at_once(ray_cluster, tiny_sd3_path):
    (h,) = create_replicas(1, tiny_sd3_path, {"max_batch_size": 4}, num_cpus=0)
    ray.get(h.shutdown.remote())
    assert ray.get(h.health.remote())["state"] == "shut down"
    calls = {"abort": h.abort.remote("r"), "abort_all": h.abort_all.remote(), "sleep": h.sleep.remote(level=1),
             "wake_up": h.wake_up.remote(), "remove_lora": h.remove_lora.remote(),
             "update_weights_from_ipc": h.update_weights_from_ipc.remote(manifest=[], buckets=[], version=1),
             "generate": h.generate.remote({"request_id": "g", "prompt": "a red car", "seed": 1,
                                                 "sampling_params": SP})}
    for name, ref in calls.items():
        with pytest.raises(ray.exceptions.RayTaskError, match=f"{name}.*shut down"):
            ray.get(ref, timeout=60)
    kill_replicas([h])
