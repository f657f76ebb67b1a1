"""Rollout replicas (Ray actors around the real engine on the tiny SD3) and the routing client."""

import asyncio
import time

import numpy as np
import pytest
import torch

from omniroll.engine.output import DiffusionOutput
from omniroll.rollout import (RequestError, RolloutClient, RolloutError, create_replicas, kill_replicas,
                              output_from_wire, output_to_wire)

SP = dict(height=64, width=64, num_inference_steps=3, max_sequence_length=16, guidance_scale=4.5)


def test_wire_round_trip():
    out = DiffusionOutput(
        diffusion_output=torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8), log_probs=torch.randn(2),
        stop_reason="completed", num_preempted=1,
        extra_fields={"all_latents": torch.randn(3, 4, 2, 2), "emb": torch.randn(5, 3).bfloat16(),
                      "prompt_ids": [1, 2], "sde_window": (0, 2), "seed": 5})
    wire = output_to_wire(out)
    assert isinstance(wire["diffusion_output"], np.ndarray)
    assert isinstance(wire["extra_fields"]["all_latents"], np.ndarray)
    back = output_from_wire(wire)
    assert torch.equal(back.diffusion_output, out.diffusion_output) and torch.equal(back.log_probs, out.log_probs)
    assert back.extra_fields["emb"].dtype == torch.bfloat16
    assert torch.equal(back.extra_fields["emb"], out.extra_fields["emb"])
    assert back.extra_fields["prompt_ids"] == [1, 2] and back.extra_fields["sde_window"] == (0, 2)
    # writable arrays are shared, not copied
    assert back.extra_fields["all_latents"].data_ptr() == wire["extra_fields"]["all_latents"].ctypes.data
    ro = {**wire, "diffusion_output": wire["diffusion_output"].copy()}
    ro["diffusion_output"].flags.writeable = False
    assert torch.equal(output_from_wire(ro).diffusion_output, out.diffusion_output)
    with pytest.raises(TypeError, match="wire-format"):
        output_from_wire({"x": 1})


@pytest.fixture(scope="module")
def replicas(ray_cluster, tiny_sd3_path):
    hs = create_replicas(2, tiny_sd3_path, {"max_batch_size": 4}, num_cpus=0)
    yield hs
    kill_replicas(hs)


def run(coro):
    return asyncio.run(coro)


def test_generate_routing_and_stats(replicas, ray_cluster):
    async def go():
        client = RolloutClient(replicas, timeout_s=60)
        outs = await asyncio.gather(*[
            client.generate(f"g{g}-{i}", "a red cat", SP, seed=100 + i, group_id=f"g{g}")
            for g in range(2) for i in range(3)])
        return client, outs

    client, outs = run(go())
    assert all(o.stop_reason == "completed" for o in outs)
    assert outs[0].diffusion_output.shape == (3, 64, 64) and outs[0].diffusion_output.dtype == torch.uint8
    # sticky: a group stays on one replica; the two groups are spread over both replicas
    reps = [o.extra_fields["replica_index"] for o in outs]
    assert len(set(reps[:3])) == 1 and len(set(reps[3:])) == 1 and reps[0] != reps[3]
    assert client.stats()["served"] == [3, 3] and client.stats()["in_flight"] == [0, 0]
    # same seed and prompt on another replica -> the identical image
    d = (outs[0].diffusion_output.int() - outs[3].diffusion_output.int()).abs()
    assert torch.equal(outs[0].diffusion_output, outs[3].diffusion_output), (
        d.max(), (d > 0).sum(), [o.extra_fields["seed"] for o in outs])
    st = ray_cluster.get(replicas[0].stats.remote())
    assert {"in_flight", "queued", "served", "weight_version", "replica_index"} <= set(st)
    assert ray_cluster.get(replicas[1].health.remote())["ok"]


def test_bad_request_is_not_retried(replicas):
    client = RolloutClient(replicas, timeout_s=60)
    with pytest.raises(RequestError, match="sampling_params.height"):
        run(client.generate("bad", "a cat", {**SP, "height": 8}, seed=1))
    with pytest.raises(RequestError, match="bogus"):
        run(client.generate("bad2", "a cat", {**SP, "bogus": 1}, seed=1))
    with pytest.raises(RequestError, match="height"):  # not a multiple of 16: rejected by the engine, not retried
        run(client.generate("bad3", "a cat", {**SP, "height": 72}, seed=1))
    assert client.stats()["healthy"] == [True, True]


def test_timeout_retries_elsewhere_then_gives_up(replicas):
    async def go(client):
        return await client.generate("slow", "a dog", {**SP, "num_inference_steps": 3}, seed=3)

    client = RolloutClient(replicas, timeout_s=1e-4, max_retries=1, unhealthy_s=0.5)
    with pytest.raises(RolloutError, match=r"'slow' failed after 2 attempt\(s\).*timed out"):
        run(go(client))
    assert client.stats()["in_flight"] == [0, 0]


def test_dead_replica_is_replaced_with_identical_output(ray_cluster, tiny_sd3_path, replicas):
    extra = create_replicas(1, tiny_sd3_path, {"max_batch_size": 4}, num_cpus=0)[0]
    ref = run(RolloutClient(replicas[:1]).generate("k", "a blue bird", SP, seed=9))
    ray_cluster.kill(extra, no_restart=True)
    client = RolloutClient([extra, replicas[0]], timeout_s=60)
    client._rr = 0  # the dead replica gets the first attempt
    out = run(client.generate("k", "a blue bird", SP, seed=9))
    assert out.extra_fields["rollout_attempts"] == 2 and out.extra_fields["replica_index"] == 1
    assert torch.equal(out.diffusion_output, ref.diffusion_output)
    assert torch.equal(out.log_probs, ref.log_probs)
    assert 0 in client.stats()["dead"]
    only_dead = RolloutClient([extra], max_retries=1)
    with pytest.raises(RolloutError, match="dead"):
        run(only_dead.generate("z", "x", SP, seed=1))


def test_bad_request_through_a_replica_fails_alone_and_benches_nothing(replicas, ray_cluster):
    """A request only the replica can refuse (its engine's max_prompt_chars) fails alone with RequestError naming it,
    is not retried and benches no replica; the requests beside it complete."""
    async def go(client):
        good = [client.generate(f"ok{i}", "a red cat", SP, seed=i, group_id="g") for i in range(3)]
        bad = client.generate("toolong", "x" * 9000, SP, seed=1, group_id="g")
        return await asyncio.gather(*good, bad, return_exceptions=True)

    client = RolloutClient(replicas, timeout_s=60)
    *good, bad = run(go(client))
    assert isinstance(bad, RequestError) and bad.request_id == "toolong"
    assert "rejected by replica" in str(bad) and "max_prompt_chars=8192" in str(bad) and "xxxxx" not in str(bad)
    assert all(o.stop_reason == "completed" and o.extra_fields["rollout_attempts"] == 1 for o in good)
    st = client.stats()
    assert st["healthy"] == [True, True] and st["dead"] == [] and st["in_flight"] == [0, 0]
    # the engine's RequestError crosses Ray as itself (what the client relies on), with its request id
    ref = replicas[0].generate.remote({"request_id": "r", "prompt": "y" * 9000, "seed": 0, "sampling_params": SP})
    with pytest.raises(RequestError) as ei:
        ray_cluster.get(ref)
    assert "max_prompt_chars" in str(ei.value)
    # an unencodable prompt is refused before any RPC, naming the field
    with pytest.raises(RequestError, match=r"'sur'.*prompt.*U\+D800"):
        run(client.generate("sur", "a \ud800", SP, seed=1))


def test_duplicate_request_id_on_a_replica_is_refused_not_retried(replicas, ray_cluster):
    long_sp = {**SP, "num_inference_steps": 400}
    first = replicas[1].generate.remote({"request_id": "same", "prompt": "a cat", "seed": 0,
                                         "sampling_params": long_sp})
    for _ in range(600):  # until the engine holds it (bounded: a broken replica fails the assert below)
        if ray_cluster.get(replicas[1].stats.remote())["in_flight"] >= 1:
            break
        time.sleep(0.05)
    client = RolloutClient([replicas[1]], timeout_s=60)  # another client: its own in-flight map does not know "same"
    with pytest.raises(RequestError, match="'same'.*already in flight"):
        run(client.generate("same", "a dog", SP, seed=1))
    assert client.stats()["healthy"] == [True]
    assert ray_cluster.get(replicas[1].abort.remote("same")) is True
    assert ray_cluster.get(first)["stop_reason"] == "aborted"

    async def twice():  # the same client refuses its own duplicate before any RPC
        c = RolloutClient(replicas, timeout_s=60)
        return await asyncio.gather(c.generate("d", "a cat", SP, seed=0), c.generate("d", "a cat", SP, seed=0),
                                    return_exceptions=True)

    a, b = run(twice())
    assert a.stop_reason == "completed" and isinstance(b, RequestError) and "already in flight on this client" in str(b)


def test_http_server_over_replicas_aborts_a_disconnected_clients_samples(replicas, ray_cluster):
    """The HTTP contract over a RolloutClient: a client that goes away has its samples aborted on the replica."""
    import json
    import socket
    import time

    import httpx

    from omniroll.http.runner import run_in_background
    from omniroll.http.server import create_app

    def totals():
        stats = ray_cluster.get([r.stats.remote() for r in replicas])
        return {k: sum(s[k] for s in stats) for k in ("in_flight", "served", "aborted")}

    def wait(cond, what):
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline, f"gave up waiting for: {what}"
            time.sleep(0.05)

    with run_in_background(create_app(RolloutClient(replicas, timeout_s=120))) as url:
        host, port = url.removeprefix("http://").split(":")
        ok = httpx.post(f"{url}/v1/images/generations", timeout=60,
                        json={"prompt": "a cat", "size": "64x64", "num_inference_steps": 2, "max_sequence_length": 16})
        assert ok.status_code == 200, ok.text
        before = totals()
        body = json.dumps({"prompt": "a long one", "n": 2, "size": "64x64", "num_inference_steps": 1000,
                           "max_sequence_length": 16}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait(lambda: totals()["in_flight"] == 2, "both samples to reach the replicas")
        sock.close()
        wait(lambda: totals()["in_flight"] == 0, "the replicas to drop the disconnected client's samples")
    after = totals()
    assert after["served"] == before["served"] and after["aborted"] == before["aborted"] + 2
