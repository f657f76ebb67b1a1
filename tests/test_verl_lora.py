"""LoRA weight sync as verl 0.9.1 and VeRL-Omni send it, into a real OmnirollServer (a Ray actor) through the real
OmnirollServerAdapter: VeRL-Omni's exact `update_weights` call sequences (`tests/verl_helpers.VerlOmniActor`), with
verl's own `collect_lora_params` / `replace_lora_wrapper` building the stream and verl's own `BucketedWeightSender`
streaming the LoRA fast path over ZMQ + shared memory.

1. merged LoRA (`lora.merge: true`): one full update, `peft_config=None`;
2. a LoRA run's first sync (`load_format: dummy`, `base_sync_done=False`): the base weights as a full update, then
   the adapter;
3. the steady state: VeRL-Omni's LoRA fast path (ZMQ, per-update socket), twice; a fast-path stream with a NaN is
   refused as a whole after the stream was drained (the sender returns), the previous adapter stays.
After each step the server's denoiser computes what the trainer's model computes."""

import asyncio
import copy
import os

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("zmq")

from tests.verl_helpers import (LoRATrainingEngine, VerlOmniActor, cpu_platform, verl_config,  # noqa: E402
                                verl_sender_class)

RANK = 7  # a replica rank no other test uses (server actor omniroll_server_7_0)


def _inputs(cfg) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, cfg.in_channels, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 5, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([500.0]))


def _server_forward(server, x):
    def run(self, x=x):
        with torch.no_grad():
            out = self.engine.adapter.denoiser(**x).sample
        return out, self.engine.weight_version, self.engine.lifecycle.active_lora
    import ray

    return ray.get(server.__ray_call__.remote(run))


@torch.no_grad()
def _forward(model, x) -> torch.Tensor:
    return model(**x).sample


@torch.no_grad()
def _train_step(peft_model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_verl_omni_lora_sync_sequences(ray_cluster, tiny_sd3_path):
    ray = ray_cluster
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model
    from verl.plugin.platform.platform_manager import get_platform, set_platform

    import omniroll.integrations.verl as ov
    from omniroll.integrations.verl.lora_sync import update_zmq_handle

    cfg = verl_config(tiny_sd3_path)
    server = ray.remote(ov.OmnirollServer).options(name=ov.server_name(RANK), num_cpus=0).remote(
        tiny_sd3_path, RANK, {"max_batch_size": 2})
    previous_platform = get_platform()
    set_platform(cpu_platform())  # verl's sender on CPU (see cpu_platform)
    try:
        ray.get(server.health.remote())
        adapter = ov.OmnirollServerAdapter(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, None,
                                           replica_rank=RANK)
        assert adapter.use_shm and adapter.zmq_handle.endswith(f"-replica-{RANK}-rank-0.sock")
        base = SD3Transformer2DModel.from_pretrained(os.path.join(tiny_sd3_path, "transformer")).eval()
        x = _inputs(base.config)
        with torch.no_grad():  # the trainer's base weights differ from the checkpoint the server loaded
            g = torch.Generator().manual_seed(11)
            for p in base.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])

        # 1. lora.merge: true -> the merged weights, peft_config=None: a full update, no adapter
        merged_model = get_peft_model(copy.deepcopy(base), lora)
        _train_step(merged_model, seed=2)
        merged_actor = VerlOmniActor(adapter, LoRATrainingEngine(merged_model, merge=True))
        (ack,) = asyncio.run(merged_actor.update_weights(global_steps=1))
        assert ack["update"] == "full" and ack["mode"] == "full" and ack["global_steps"] == 1
        out, version, active = _server_forward(server, x)
        assert active is None and version == 1
        torch.testing.assert_close(out, _forward(merged_model, x), rtol=1e-5, atol=1e-5)

        # 2. a LoRA run's first sync (load_format dummy): base weights (full), then the adapter
        peft_model = get_peft_model(copy.deepcopy(base), lora)
        _train_step(peft_model, seed=3)
        actor = VerlOmniActor(adapter, LoRATrainingEngine(peft_model))
        assert not actor.base_sync_done
        base_ack, lora_ack = asyncio.run(actor.update_weights(global_steps=1))
        assert base_ack["update"] == "base" and base_ack["mode"] == "full"
        assert lora_ack["update"] == "lora" and lora_ack["mode"] == "lora" and adapter.sleep_level == 1
        out, version, active = _server_forward(server, x)
        assert active is not None and version == 3
        torch.testing.assert_close(out, _forward(peft_model, x), rtol=1e-5, atol=1e-5)
        with peft_model.disable_adapter():  # the base weights landed too: not the merged run's
            assert not torch.allclose(_forward(peft_model, x), _forward(merged_model, x), atol=1e-3)

        # 3. steady state: VeRL-Omni's LoRA fast path over ZMQ (per-update socket), twice
        for step in (2, 3):
            _train_step(peft_model, seed=10 + step)
            ack = asyncio.run(actor.update_weights(global_steps=step))
            assert ack["update"] == "lora" and ack["num_tensors"] == len(
                [n for n, _ in peft_model.named_parameters() if "lora_" in n])
            assert ack["global_steps"] == 1  # the fast path sends no step (VeRL-Omni calls no set_global_steps)
            out, version, _ = _server_forward(server, x)
            assert version == 2 + step
            torch.testing.assert_close(out, _forward(peft_model, x), rtol=1e-5, atol=1e-5)
        expected = _forward(peft_model, x)

        # a fast-path stream with a NaN: refused as a whole once drained (the sender returned), previous adapter kept
        with torch.no_grad():
            next(p for n, p in peft_model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
        with pytest.raises(Exception, match="non-finite"):
            asyncio.run(actor.update_weights(global_steps=4))
        out, version, _ = _server_forward(server, x)
        assert version == 5
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("verl_weights_")]  # the sender unlinked it

        # an unknown keyword is refused once the stream was drained (the sender returns), nothing applied
        future = server.update_weights_from_ipc.remote({"r": 4}, True, True, zmq_update_id="odd", update_seq=1)
        lora_stream, _ = actor.engine.get_per_tensor_param(base_sync_done=True)
        asyncio.run(verl_sender_class()(zmq_handle=update_zmq_handle(adapter.zmq_handle, "odd"), bucket_size_mb=1,
                                        use_shm=True).async_send_weights(lora_stream))
        with pytest.raises(Exception, match=r"unknown keyword\(s\) \['update_seq'\]"):
            ray.get(future)
        assert _server_forward(server, x)[1] == 5

        # a receiver that is sent nothing gives up after its timeout with a clear error (no hang)
        with pytest.raises(Exception, match="no buffer description"):
            ray.get(server.update_weights_from_ipc.remote({"r": 4}, True, True, zmq_update_id="nobody",
                                                          timeout_s=0.5))
    finally:
        set_platform(previous_platform)
        ray.kill(server, no_restart=True)


def test_verl_lora_convention_and_zmq_naming():
    from omniroll.integrations.verl.lora_sync import engine_update, is_lora_update, update_zmq_handle, zmq_handle_for
    from omniroll.weights.full import peft_base_name

    assert is_lora_update({"r": 4}, True) and not is_lora_update({"r": 4}, False) and not is_lora_update(None, True)
    assert engine_update({"r": 4}, True)[::2] == ({"r": 4}, "lora")
    assert engine_update({"r": 4}, False) == (None, peft_base_name, "base")
    assert engine_update(None, True) == (None, None, "full") == engine_update(None, False)
    from omniroll.integrations.verl.zmq_receiver import private_socket_dir

    h = zmq_handle_for("01000000", 3)
    assert h == f"ipc://{private_socket_dir()}/rl-colocate-zmq-01000000-replica-3-rank-0.sock"
    assert update_zmq_handle(h, "step-2-seq-0") == \
        f"ipc://{private_socket_dir()}/rl-colocate-zmq-01000000-replica-3-rank-0-update-step-2-seq-0.sock"
    assert update_zmq_handle(h, None) == h and update_zmq_handle("tcp://1.2.3.4:5", "x") == "tcp://1.2.3.4:5"


def test_the_pickled_zmq_stream_only_uses_a_socket_only_this_user_can_open(tmp_path, monkeypatch):
    """verl's wire protocol is pickle: the receiver accepts only an ipc:// path in this user's 0700 directory."""
    import stat

    from omniroll.integrations.verl.zmq_receiver import (check_socket_handle, private_socket_dir,
                                                          receive_zmq_stream)
    from omniroll.weights import WeightSyncError

    d = private_socket_dir()
    st = os.stat(d)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    ok = f"ipc://{d}/x.sock"
    assert check_socket_handle(ok) == ok
    for bad in ("tcp://127.0.0.1:5555", "ipc:///tmp/rl-colocate-zmq-1-replica-0-rank-0.sock", f"ipc://{d}/../y.sock"):
        with pytest.raises(WeightSyncError, match="pickled"):
            receive_zmq_stream(bad, True, timeout_s=1)  # refused before connecting: nothing is read
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # a directory others could open is refused
    os.makedirs(tmp_path / f"omniroll-zmq-{os.getuid()}", mode=0o755)
    os.chmod(tmp_path / f"omniroll-zmq-{os.getuid()}", 0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        private_socket_dir()


def _stream(tensors, receiver_use_shm=True, bucket_size_mb=1):
    """verl's real sender -> omniroll's receiver (a thread), in one process; returns (received, receiver error)."""
    import threading
    import uuid

    from verl.plugin.platform.platform_manager import get_platform, set_platform

    from omniroll.integrations.verl.zmq_receiver import private_socket_dir, receive_zmq_stream

    handle = f"ipc://{private_socket_dir()}/omniroll-test-{uuid.uuid4().hex[:12]}.sock"
    result: dict = {}

    def receive():
        try:
            result["named"] = receive_zmq_stream(handle, receiver_use_shm, timeout_s=30)
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=receive)
    thread.start()
    previous = get_platform()
    set_platform(cpu_platform())
    try:
        asyncio.run(verl_sender_class()(zmq_handle=handle, bucket_size_mb=bucket_size_mb, use_shm=True)
                    .async_send_weights(iter(tensors)))
    finally:
        set_platform(previous)
        thread.join(30)
    assert not thread.is_alive()
    return result.get("named"), result.get("error")


def test_verl_sender_to_omniroll_receiver_over_several_buckets():
    g = torch.Generator().manual_seed(0)
    sent = [(f"w{i}", torch.randn(300 * 256 + i, generator=g).to(dtype)) for i, dtype in
            enumerate([torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32])]
    sent.append(("idx", torch.arange(7, dtype=torch.int64).reshape(7, 1)))
    named, error = _stream(sent, bucket_size_mb=1)  # 1 MiB buckets: the stream spans several
    assert error is None
    assert [n for n, _ in named] == [n for n, _ in sent]
    for (_, a), (_, b) in zip(named, sent):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_stream_the_receiver_refuses_is_drained_first():
    named, error = _stream([("w", torch.ones(4))], receiver_use_shm=False)  # the sender returned: no hang
    assert named is None and "use_shm=False" in str(error)
