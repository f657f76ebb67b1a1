"""Multi-node, on a real Ray cluster of several raylets on this machine (`ray.cluster_utils.Cluster`): a head node
(the trainer's) and two worker nodes, each with its own node id, one CPU and a custom resource so placement is
observable. The session's local Ray is shut down for this module and started again after it (one Ray at a time).

What is checked: `spread` puts replicas on distinct nodes; the weight sender chooses shm for the replica on its own
node and the object store for the others (the choice, read from the acks: on one machine /dev/shm would work for
all); a forced shm to another node fails before any byte moves, naming replica and node; `omniroll train` (the real
command, joining the cluster with --ray-address) runs 2 steps with its replicas on the two worker nodes; a node
removed mid-rollout (holding a replica, the only reward worker and the only agent-loop worker, which Ray restarts
elsewhere) still returns every sample, bitwise equal to a run without the fault; a sync during which a
receiver's node disappears (before the send, and in the middle of it: the victim has every bucket and waits to
commit) fails as a whole naming it, the survivors hold the complete update, and the next sync to them works.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from omniroll.agent_loop.batch import DataBatch  # noqa: E402
from omniroll.config import load_config  # noqa: E402

SP = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5, "max_sequence_length": 8}


@pytest.fixture(scope="module")
def nodes():
    """(cluster, {"head": node id, "w0": ..., "w1": ...}); restores the session's local Ray afterwards."""
    from ray.cluster_utils import Cluster

    had_local = ray.is_initialized()
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 4},
                                                            "include_dashboard": False})
    # "rw" / "aw": one reward / agent-loop worker each (the fault test adds a node holding one of each)
    workers = [cluster.add_node(num_cpus=1, resources={"worker": 4, "w0": 4, "rw": 1}),
               cluster.add_node(num_cpus=1, resources={"worker": 4, "w1": 4, "aw": 1})]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    ids = {"head": cluster.head_node.node_id, "w0": workers[0].node_id, "w1": workers[1].node_id}
    try:
        yield cluster, workers, ids
    finally:
        ray.shutdown()
        cluster.shutdown()
        if had_local:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)


def rollout_config(model, **replicas):
    return load_config({
        "replicas": {"count": 2, "num_cpus": 1, **replicas},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1},
        "pipeline": SP, "algo": {"noise_level": 1.0, "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 2, "placement": "spread", "resources": {"aw": 1}},
        "reward": {"num_workers": 2, "placement": "spread", "resources": {"rw": 1},
                   "functions": {"colour": {"fn": "prompt_colour"}}},
        "n": 2, "prompt_length": 77, "seed": 0, "timeout_s": 120, "max_retries": 3,
    })


def batch(prompts, n=2, step=1):
    rows = [i for i in range(len(prompts)) for _ in range(n)]
    return DataBatch.from_dict(non_tensors={"raw_prompt": [prompts[i] for i in rows],
                                            "uid": [f"p{i}" for i in rows]},
                               meta_info={"global_steps": step, "rollout_seed": 0})


def where(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_spread_puts_replicas_on_distinct_nodes_and_they_say_where(nodes, tiny_sd3_path):
    from omniroll.agent_loop.cluster import RolloutCluster

    _, _, ids = nodes
    lines = []
    with RolloutCluster(rollout_config(tiny_sd3_path, placement="spread", resources={"worker": 1}),
                        with_rewards=False, with_manager=False, log=lines.append) as c:
        assert c.info.nodes == 3 and c.info.cpus == 3 and "3 node(s), 3 CPUs" in lines[0]
        health = ray.get([r.health.remote() for r in c.replicas])
        assert sorted(h["node_id"] for h in health) == sorted([ids["w0"], ids["w1"]])
        assert all(h["node_address"] for h in health) and c.replica_nodes == [h["node_id"] for h in health]


def test_auto_transport_shm_on_the_senders_node_object_store_elsewhere_forced_shm_refused(nodes, tiny_sd3_path):
    from omniroll.models import load_adapter
    from omniroll.rollout.replica import create_replicas, kill_replicas
    from omniroll.weights import WeightSender, WeightSyncError
    from omniroll.weights.transport import leftover_shm

    _, _, ids = nodes
    kw = {"max_batch_size": 4, "num_threads": 1}
    here = create_replicas(1, tiny_sd3_path, kw, num_cpus=0, resources={"head": 1})
    there = create_replicas(1, tiny_sd3_path, kw, num_cpus=0, resources={"w1": 1})
    weights = load_adapter(tiny_sd3_path).denoiser.state_dict()
    try:
        acks = WeightSender(here + there).send(weights, version=1)
        assert [(a["transport"], a["node_id"], a["version"]) for a in acks] == [
            ("shm", ids["head"], 1), ("object_store", ids["w1"], 1)]
        with pytest.raises(WeightSyncError, match=f"replica 1 on node {ids['w1']}.*nothing was sent"):
            WeightSender(here + there, transport="shm").send(weights, version=2)
        assert [h["weight_version"] for h in ray.get([r.health.remote() for r in here + there])] == [1, 1]
        assert leftover_shm() == []
    finally:
        kill_replicas(here + there)


def test_omniroll_train_joins_the_cluster_and_trains_on_two_worker_nodes(nodes, tiny_sd3_path, tmp_path):
    import yaml

    cluster, _, ids = nodes
    cfg = {
        "replicas": {"count": 2, "num_cpus": 1, "placement": "spread", "resources": {"worker": 1}},
        "engine": {"model": tiny_sd3_path, "max_batch_size": 16, "num_threads": 1},
        "pipeline": SP, "algo": {"noise_level": 1.0, "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 1}, "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"}}},
        "n": 2, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"prompts": ["a blue car", "a green bird"], "prompts_per_step": 2, "steps": 2,
                    "micro_batch_size": 4, "num_threads": 1},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMNIROLL_OVERRIDES")}
    main = "import sys; from omniroll.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", main, "train", "--config", str(path), "--out", str(out),
                        "--quiet", "--ray-address", cluster.address], capture_output=True, text=True, timeout=300,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    assert f"Ray: joined {cluster.address} (3 node(s), 3 CPUs" in p.stdout
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [m["synced_version"] for m in lines] == [1, 2] and all(m["ratio_max_abs_dev"] == 0.0 for m in lines)
    replicas_line = next(x for x in p.stdout.splitlines() if "replica(s) on 2 node(s)" in x)
    assert ids["w0"][:8] in replicas_line and ids["w1"][:8] in replicas_line and ids["head"][:8] not in replicas_line


def test_a_receivers_node_removed_in_the_middle_of_a_sync_fails_it_naming_replica_and_node_survivors_go_on(
        nodes, tiny_sd3_path):
    """The victim's replica has every bucket (received and checked) and waits to commit: its one sample is paused
    in flight and the sync waits for samples in flight. Its node is removed there. The sync fails as a whole, naming
    the replica and its node; the survivors (shm on the sender's node, the object store on another) each landed the
    complete update (each receiver's update is all-or-nothing; nothing half-applied); the next sync to them works."""
    import threading

    from omniroll.models import load_adapter
    from omniroll.rollout.replica import create_replicas, kill_replicas
    from omniroll.weights import WeightSender, WeightSyncError
    from omniroll.weights.transport import leftover_shm

    cluster, _, ids = nodes
    victim = cluster.add_node(num_cpus=1, resources={"victim_sync": 4})
    cluster.wait_for_nodes()
    kw = {"max_batch_size": 4, "num_threads": 1}
    survivors = (create_replicas(1, tiny_sd3_path, kw, num_cpus=0, resources={"head": 1})
                 + create_replicas(1, tiny_sd3_path, kw, num_cpus=0, resources={"w0": 1}))
    doomed = create_replicas(1, tiny_sd3_path, kw, num_cpus=0, resources={"victim_sync": 1})[0]
    weights = load_adapter(tiny_sd3_path).denoiser.state_dict()
    try:
        ray.get(doomed.pause_generation.remote(after_steps=1, timeout_s=120))
        pending = doomed.generate.remote({"request_id": "in-flight", "prompt": "a red car", "seed": 1,
                                          "sampling_params": SP})
        assert ray.get(doomed.wait_for_pause.remote(timeout_s=120))["steps"] == 1
        sender = WeightSender(survivors + [doomed], timeout_s=120)
        assert sender.routes() == ["shm", "object_store", "object_store"]
        result = {}

        def sync():
            try:
                result["acks"] = sender.send(weights, version=1, wait_for_inflight=True)
            except BaseException as e:  # noqa: BLE001 - checked below
                result["error"] = e

        t = threading.Thread(target=sync)
        t.start()
        deadline = time.monotonic() + 60
        # the update has arrived whole (admission closes only after every bucket was received and checked)
        while not ray.get(doomed.stats.remote())["admission_paused"]:
            assert time.monotonic() < deadline and t.is_alive(), result
            time.sleep(0.05)
        assert ray.get(doomed.stats.remote())["weight_version"] == 0  # not committed: waiting for its sample
        cluster.remove_node(victim)
        t.join(timeout=120)
        assert not t.is_alive(), "the sync hung after its receiver's node was removed"
        err = result.get("error")
        assert isinstance(err, WeightSyncError), result
        assert f"replica 2 on node {victim.node_id}" in str(err) and "failed as a whole" in str(err)
        assert "replica 0" not in str(err) and "replica 1" not in str(err)
        with pytest.raises(ray.exceptions.RayError):
            ray.get(pending, timeout=60)
        assert [h["weight_version"] for h in ray.get([r.health.remote() for r in survivors])] == [1, 1]
        acks = WeightSender(survivors).send(weights, version=2)
        assert [(a["version"], a["transport"], a["node_id"]) for a in acks] == [
            (2, "shm", ids["head"]), (2, "object_store", ids["w0"])]
        assert leftover_shm() == []
    finally:
        kill_replicas(survivors + [doomed])


def test_a_node_removed_mid_rollout_every_sample_comes_back_bitwise_the_trainer_goes_on_with_the_survivors(
        nodes, tiny_sd3_path, tmp_path):
    """The removed node holds a replica, the only reward worker and the only agent-loop worker (the case a real
    multi-node run hit: with a second worker of each role on another node, as this test had, a node loss never needed
    more than the survivors). Ray restarts the two workers on other nodes; every sample comes back bitwise."""
    from omniroll.train import Trainer
    from omniroll.weights import WeightSender, WeightSyncError

    cluster, workers, ids = nodes
    prompts = ["a blue car", "a green bird", "a red cube"]  # 3 groups on one agent-loop worker, whose client puts
    # one on each of the 3 idle replicas
    # w0's "rw" and w1's "aw" are held while the trainer starts, so its one reward worker and one agent-loop worker
    # start on the victim (the only node with room), and are released before the fault: the restarts go there
    class Hold:  # holds the resources it was created with (defined here: Ray ships it by value)
        pass

    hold = ray.remote(num_cpus=0)(Hold)
    held = [hold.options(resources={"rw": 1}).remote(), hold.options(resources={"aw": 1}).remote()]
    ray.get([h.__ray_ready__.remote() for h in held])
    victim = cluster.add_node(num_cpus=1, resources={"worker": 4, "victim": 4, "rw": 1, "aw": 1})
    cluster.wait_for_nodes()
    cfg = rollout_config(tiny_sd3_path, placement="spread", resources={"worker": 1}, count=3).model_dump()
    cfg["agent"]["num_workers"] = cfg["reward"]["num_workers"] = 1
    cfg["trainer"] = {"prompts": prompts, "prompts_per_step": 3, "steps": 1, "micro_batch_size": 6, "num_threads": 1}
    lines = []
    with Trainer(load_config(cfg), str(tmp_path / "out"), log=lines.append) as tr:
        c = tr.cluster
        on_victim = [i for i, n in enumerate(c.replica_nodes) if n == victim.node_id]
        assert len(on_victim) == 1 and len(set(c.replica_nodes)) == 3
        assert [where(c.reward_workers[0]), where(c.manager.workers[0])] == [victim.node_id] * 2
        for h in held:
            ray.kill(h)
        ref = asyncio.run(tr.manager.generate_sequences_async(batch(prompts)))
        sender = WeightSender(tr.replicas, bucket_bytes=64 << 10)
        assert sender.nodes == c.replica_nodes

        async def with_fault():
            task = asyncio.ensure_future(tr.manager.generate_sequences_async(batch(prompts)))
            deadline = time.monotonic() + 120
            while ray.get(c.replicas[on_victim[0]].stats.remote())["running"] == 0:  # a request runs there
                assert time.monotonic() < deadline and not task.done(), "nothing ran on the victim's replica"
                await asyncio.sleep(0.02)
            cluster.remove_node(victim)
            return await task

        got = asyncio.run(with_fault())
        for k in ("responses", "all_latents", "rollout_log_probs", "rm_scores"):
            assert torch.equal(got.batch[k], ref.batch[k]), k
        assert list(got.non_tensor_batch["request_id"]) == list(ref.non_tensor_batch["request_id"])
        # the same handles, restarted where there was room
        assert [where(c.reward_workers[0]), where(c.manager.workers[0])] == [ids["w0"], ids["w1"]]
        assert set(ref.non_tensor_batch["replica_node_id"]) <= {ids["w0"], ids["w1"], victim.node_id}

        # the trainer's next step: it says in one line that it goes on without the lost replica; its sync works
        m = tr.step(1)
        assert [x for x in lines if "lost" in x] == [f"lost 1 replica(s) (node(s) {victim.node_id} left the "
                                                    f"cluster): continuing with 2 replica(s)"]
        assert m["synced_version"] == 1 and len(tr.replicas) == 2
        # a sync to a receiver whose node is gone fails as a whole, naming replica and node; the next one to the
        # survivors works
        with pytest.raises(WeightSyncError, match=f"failed as a whole.*replica {on_victim[0]} on node "
                                                  f"{victim.node_id}: gone"):
            sender.send(tr.policy.weights_to_send(), version=2)
        acks = WeightSender(tr.replicas).send(tr.policy.weights_to_send(), version=3)
        assert [(a["version"], a["transport"]) for a in acks] == [(3, "object_store")] * 2
        again = asyncio.run(tr.manager.generate_sequences_async(batch(prompts, step=2)))
        assert set(again.non_tensor_batch["weight_version"]) == {3}
        assert set(again.non_tensor_batch["replica_node_id"]) == {ids["w0"], ids["w1"]}
