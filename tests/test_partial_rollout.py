"""Partial rollouts in the engine: a weight update that lands between two denoising steps of samples in flight.

The swap is placed by `pause_generation(after_steps=k)` (not by timing): samples run k steps, the engine pauses, a
`partial=True` update lands, generation resumes. Every window step records the version that ran it
(`step_weight_versions`), and its log-prob equals a recompute under that version, bitwise, for LoRA and full
weights and every SDE type; a sample's result does not depend on its batch mates across the switch either.
"""

import concurrent.futures as cf
import time

import pytest
import torch
from peft import LoraConfig

from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
from omniroll.models import load_adapter
from omniroll.train import TrajectoryBatch, recompute_log_probs
from omniroll.trajectory_file import batch_from_outputs, read_trajectories, write_trajectories
from omniroll.weights import WeightSender

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
T = 6  # denoising steps; the updates land after steps 2 and 4: versions (a, a, b, b, c, c)


def params(sde_type="sde", **kw):
    base = dict(height=32, width=32, num_inference_steps=T, guidance_scale=4.5, max_sequence_length=8,
                noise_level=0.8, sde_type=sde_type, sde_window_size=3, sde_window_range=(0, T))
    return SamplingParams(**{**base, **kw})


def requests(sde_type, prefix=""):
    """Mixed rows: prompts, seeds, guidance, and a prefix-sharing group (same latent_seed)."""
    rows = [("a red car", 0, {}), ("a blue bird", 1, {}), ("a red car", 2, {"guidance_scale": 7.0}),
            ("a green tree", 3, {"latent_seed": 77, "sde_window_range": (2, T)}),
            ("a green tree", 4, {"latent_seed": 77, "sde_window_range": (2, T)})]
    return [GenerationRequest(request_id=f"{prefix}{i}", prompt=p, seed=s, sampling_params=params(sde_type, **kw))
            for i, (p, s, kw) in enumerate(rows)]


def run_with_updates(engine, reqs, updates):
    """Generate `reqs`; each (after_steps, push) lands `push(partial=True)` after that many more engine steps."""
    with cf.ThreadPoolExecutor(1) as pool:
        engine.pause_generation(after_steps=updates[0][0])
        future = pool.submit(engine.generate, reqs)
        for i, (_, push) in enumerate(updates):
            info = engine.wait_for_pause()
            assert sorted(info["running"]) == sorted(r.request_id for r in reqs)  # nothing finished, nothing aborted
            ack = push()
            assert ack["aborted"] == [] and sorted(ack["continued"]) == sorted(info["running"])
            if i + 1 < len(updates):
                engine.pause_generation(after_steps=updates[i + 1][0])  # replaces the pause: generation goes on
            else:
                assert engine.resume_generation() == {"resumed": True}
        return future.result(timeout=120)


class Versions:
    """The weights behind every version an engine has run, and a policy that can load any of them."""

    def __init__(self, engine, policy, lora: bool):
        self.engine, self.policy, self.lora = engine, policy, lora
        self.sender = WeightSender([engine])
        self.states = {engine.weight_version: self._state()}

    def _state(self):
        return {n: p.detach().clone() for n, p in self.policy.denoiser.named_parameters()
                if not self.lora or "lora_" in n}

    def new(self, seed):
        """A push (call it to send): the policy moves to fresh weights (LoRA B matrices, or every parameter), which
        are recorded and sent as the next version with partial=True."""

        @torch.no_grad()
        def push():
            g = torch.Generator().manual_seed(seed)
            for n, p in self.policy.denoiser.named_parameters():
                if not self.lora or "lora_B" in n:
                    p.add_(torch.randn(p.shape, generator=g) * (0.1 if self.lora else 0.02))
            version = max(self.states) + 1
            self.states[version] = self._state()
            return self.sender.send(self.policy.denoiser, version=version, partial=True)[0]

        return push

    @torch.no_grad()
    def load(self, version):
        named = dict(self.policy.denoiser.named_parameters())
        for n, v in self.states[version].items():
            named[n].copy_(v)


def make(tiny_sd3_path, lora):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    policy = load_adapter(tiny_sd3_path)
    if lora:
        policy.denoiser.add_adapter(LORA)
    versions = Versions(engine, policy, lora)
    if lora:
        versions.new(100)()  # version 1: a LoRA adapter that changes the output
    return engine, versions


@pytest.fixture(scope="module", params=["lora", "full"])
def setup(request, tiny_sd3_path):
    engine, versions = make(tiny_sd3_path, request.param == "lora")
    yield versions
    engine.shutdown()


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_every_window_step_equals_a_recompute_under_its_own_version(setup, sde_type, tmp_path):
    versions = setup
    engine = versions.engine
    a = engine.weight_version
    reqs = requests(sde_type)
    outs = run_with_updates(engine, reqs, [(2, versions.new(1)), (2, versions.new(2))])
    b, c = a + 1, a + 2
    by_step = [a, a, b, b, c, c]
    assert engine.weight_version == c
    for o in outs:
        ef = o.extra_fields
        assert o.stop_reason == "completed"
        steps = ef["step_indices"].tolist()
        assert ef["step_weight_versions"] == [by_step[k] for k in steps] == o.step_weight_versions
        assert ef["weight_version"] == a  # the version that ran the first step (a prefix follower: its leader's)
        assert (ef["min_weight_version"], ef["max_weight_version"]) == (by_step[steps[0]], by_step[steps[-1]])
    spanning = [o for o in outs if len(set(o.step_weight_versions)) > 1]
    assert spanning, "the windows must straddle an update for this test to mean anything"
    # the rows as the agent loop's DataBatch and the trajectory file carry them
    batch = batch_from_outputs(outs, [r.prompt for r in reqs], 1)
    write_trajectories(batch, str(tmp_path / "t.safetensors"), run={})
    back = read_trajectories(str(tmp_path / "t.safetensors"))
    for nt in (batch.non_tensor_batch, back.non_tensor_batch):
        assert list(nt["step_weight_versions"]) == [o.step_weight_versions for o in outs]
        assert list(nt["min_weight_version"]) == [min(o.step_weight_versions) for o in outs]
        assert list(nt["max_weight_version"]) == [max(o.step_weight_versions) for o in outs]
        assert list(nt["weight_version"]) == [a] * len(outs)
    assert (batch.meta_info["min_weight_version"], batch.meta_info["max_weight_version"]) == (a, c)
    traj = TrajectoryBatch.from_batch(back)
    for k in range(traj.num_steps):
        for v in sorted({o.step_weight_versions[k] for o in outs}):
            rows = [i for i, o in enumerate(outs) if o.step_weight_versions[k] == v]
            assert rows == [i for i, o in enumerate(back.non_tensor_batch["step_weight_versions"]) if o[k] == v]
            versions.load(v)
            with torch.no_grad():
                got = recompute_log_probs(versions.policy, traj.rows(rows), k).log_prob
            assert torch.equal(got, traj.log_probs[rows, k]), (sde_type, k, v, rows)
            other = next((u for u in versions.states if u != v), None)
            versions.load(other)  # another version's weights do not reproduce it: the check can fail
            with torch.no_grad():
                assert not torch.equal(recompute_log_probs(versions.policy, traj.rows(rows), k).log_prob,
                                       traj.log_probs[rows, k])
    versions.load(c)


def test_a_sample_does_not_depend_on_its_batch_mates_across_a_version_switch(tiny_sd3_path):
    """The same request alone and with batch mates (other prompts, guidance, SDE types, noise levels, step counts),
    with the same updates landing after the same steps: bitwise the same latents, log-probs, pixels and versions."""
    x = GenerationRequest(request_id="x", prompt="a red car", seed=5, sampling_params=params("sde"))
    mates = [GenerationRequest(request_id="m0", prompt="a blue bird on a long branch", seed=6,
                               sampling_params=params("cps", guidance_scale=7.0)),
             GenerationRequest(request_id="m1", prompt="a cat", seed=7,
                               sampling_params=params("dance_sde", noise_level=0.5, guidance_scale=1.0)),
             GenerationRequest(request_id="m2", prompt="a red car", seed=8,
                               sampling_params=params("sde", num_inference_steps=8, sde_window_range=(0, 8)))]
    results = []
    for batch in ([x], [mates[0], x] + mates[1:]):
        engine, versions = make(tiny_sd3_path, lora=False)
        try:
            outs = run_with_updates(engine, batch, [(1, versions.new(1)), (3, versions.new(2))])
        finally:
            engine.shutdown()
        results.append(next(o for o in outs if o.request_id == "x"))
    alone, mixed = results
    assert alone.step_weight_versions == mixed.step_weight_versions and len(set(alone.step_weight_versions)) > 1
    assert torch.equal(alone.log_probs, mixed.log_probs)
    assert torch.equal(alone.extra_fields["all_latents"], mixed.extra_fields["all_latents"])
    assert torch.equal(alone.diffusion_output, mixed.diffusion_output)


def test_a_sync_that_waits_for_the_samples_in_flight(tiny_sd3_path):
    """partial=False with drain_timeout_s=None: the update waits until the samples in flight finish on the old
    weights (none spans two versions, none is aborted); while they cannot finish (paused), it times out and changes
    nothing."""
    engine, versions = make(tiny_sd3_path, lora=False)
    try:
        with torch.no_grad():
            for p in versions.policy.denoiser.parameters():
                p.mul_(1.01)  # version 1, sent below with partial=False
        sender = versions.sender
        reqs = requests("sde", prefix="w")[:3]
        with cf.ThreadPoolExecutor(2) as pool:
            engine.pause_generation(after_steps=2)
            future = pool.submit(engine.generate, reqs)
            engine.wait_for_pause()
            with pytest.raises(TimeoutError, match="still in flight"):
                engine.update_weights_from_ipc(**_stream(sender, versions.policy.denoiser), version=1,
                                               drain_timeout_s=None, timeout_s=1.0)
            assert engine.weight_version == 0 and engine.stats()["running"] == 3
            sync = pool.submit(sender.send, versions.policy.denoiser, version=1, wait_for_inflight=True)
            while not engine.admission_paused:  # the sync is draining (a state, not a timing guess)
                if sync.done():
                    sync.result()
                time.sleep(0.001)
            engine.resume_generation()
            (ack,) = sync.result(timeout=60)
            outs = future.result(timeout=60)
        assert ack["aborted"] == [] and ack["version"] == 1
        assert all(o.step_weight_versions == [0] * 3 and o.weight_version == 0 for o in outs)
        after = engine.generate([GenerationRequest(request_id="late", prompt="a cat", seed=1,
                                                   sampling_params=params())])[0]
        assert after.step_weight_versions == [1] * 3 and after.weight_version == 1
    finally:
        engine.shutdown()


def _stream(sender, module):
    """The manifest and buckets WeightSender would send for `module` (full weights), as update kwargs."""
    from omniroll.weights.buckets import WeightManifest, pack_buckets
    from omniroll.weights.sender import named_tensors_for

    named, _ = named_tensors_for(module, None)
    return dict(manifest=WeightManifest.from_named_tensors(named),
                buckets=list(pack_buckets(named, sender.bucket_bytes, by_reference=True)))


def test_pause_controls_refuse_bad_input_and_never_hang(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path)
    try:
        for bad in (-1, True, 1.5, "2"):
            with pytest.raises(ValueError, match="after_steps"):
                engine.pause_generation(after_steps=bad)
        with pytest.raises(ValueError, match="timeout_s"):
            engine.pause_generation(timeout_s=0)
        with pytest.raises(ValueError, match="partial must be a bool"):
            engine.update_weights_from_ipc(manifest=[], buckets=[], version=1, partial="yes")
        with pytest.raises(ValueError, match="partial must be a bool"):
            WeightSender([engine]).send({}, version=1, partial=1)
        with pytest.raises(ValueError, match="wait_for_inflight"):
            WeightSender([engine]).send({}, version=1, partial=True, wait_for_inflight=True)
        engine.pause_generation(after_steps=3)  # armed; no request: it never begins
        with pytest.raises(TimeoutError, match="no pause began"):
            engine.wait_for_pause(timeout_s=0.05)
        assert engine.resume_generation() == {"resumed": False}
        engine.pause_generation(after_steps=0, timeout_s=0.2)  # paused now; nobody resumes: it ends by itself
        out = engine.generate([GenerationRequest(request_id="t", prompt="a cat", seed=1, sampling_params=params())])
        assert out[0].stop_reason == "completed" and not engine.stats()["paused"]
    finally:
        engine.shutdown()


def test_a_replica_actor_takes_a_partial_sync_mid_rollout(ray_cluster, tiny_sd3_path):
    """Through Ray: RolloutReplica.pause_generation / wait_for_pause / resume_generation, and WeightSender(transport=
    "ray").send(partial=True): the samples in flight continue, each step's version reaches the wire output."""
    import ray

    from omniroll.rollout.replica import create_replicas, kill_replicas
    from omniroll.rollout.wire import output_from_wire

    (replica,) = create_replicas(1, tiny_sd3_path, engine_kwargs={"num_threads": 1})
    try:
        policy = load_adapter(tiny_sd3_path)
        ray.get(replica.pause_generation.remote(after_steps=0))  # paused now: both requests start together
        refs = [replica.generate.remote(r.model_dump()) for r in requests("sde", prefix="r")[:2]]
        while ray.get(replica.stats.remote())["queued"] < 2:  # a state, not a timing guess
            time.sleep(0.01)
        ray.get(replica.pause_generation.remote(after_steps=3))
        assert ray.get(replica.wait_for_pause.remote())["steps"] == 3
        with torch.no_grad():
            for p in policy.denoiser.parameters():
                p.mul_(1.01)
        acks = WeightSender([replica], transport="ray").send(policy.denoiser, version=1, partial=True)
        assert acks[0]["version"] == 1 and acks[0]["aborted"] == [] and len(acks[0]["continued"]) == 2
        ray.get(replica.resume_generation.remote())
        outs = [output_from_wire(w) for w in ray.get(refs)]
        for o in outs:
            steps = o.extra_fields["step_indices"].tolist()
            assert o.step_weight_versions == [0 if k < 3 else 1 for k in steps]
            assert o.extra_fields["min_weight_version"] == min(o.step_weight_versions)
    finally:
        kill_replicas([replica])
