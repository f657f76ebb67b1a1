"""Agent loop on real Ray replicas of the tiny SD3: output contract, chunking/replica invariance, a replica killed
mid-batch, streaming rewards, bad inputs."""

import asyncio
import time

import numpy as np
import pytest
import torch

from omniroll.agent_loop import AgentLoopError, DataBatch, DiffusionAgentLoopWorker
from omniroll.agent_loop.manager import AgentLoopManager
from omniroll.config import load_config
from omniroll.rollout import RolloutClient, create_replicas, kill_replicas

PIPE = {"height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 4.5, "max_sequence_length": 16}


def cfg_for(path, **over):
    base = {"engine": {"model": path, "max_batch_size": 4}, "pipeline": PIPE, "agent": {"num_workers": 2},
            "prompt_length": 128, "seed": 3, "timeout_s": 60}
    for k, v in over.items():
        sect, _, key = k.partition("__")
        (base.setdefault(sect, {}) if key else base)[key or k] = v
    return load_config(base)


def make_batch(rows, global_steps=1, **meta):
    """rows: list of (uid, prompt) or dicts of non-tensor fields."""
    rows = [r if isinstance(r, dict) else {"uid": r[0], "raw_prompt": r[1]} for r in rows]
    keys = sorted({k for r in rows for k in r})
    nt = {k: [r.get(k) for r in rows] for k in keys}
    nt["data_source"] = ["test"] * len(rows)
    return DataBatch.from_dict(non_tensors=nt, meta_info={"global_steps": global_steps, **meta})


ROWS5 = [("u0", "a red cat"), ("u0", "a red cat"), ("u1", [{"role": "system", "content": "be nice"},
                                                           {"role": "user", "content": "a blue dog"}]),
         ("u1", [{"role": "user", "content": "a blue dog"}]), ("u2", "a green tree")]


@pytest.fixture(scope="module")
def replicas(ray_cluster, tiny_sd3_path):
    hs = create_replicas(2, tiny_sd3_path, {"max_batch_size": 4}, num_cpus=0)
    yield hs
    kill_replicas(hs)


@pytest.fixture(scope="module")
def cfg(tiny_sd3_path):
    return cfg_for(tiny_sd3_path)


@pytest.fixture(scope="module")
def baseline(cfg, replicas):
    """ROWS5 on one replica, one in-process worker."""
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]))
    return asyncio.run(worker.generate_sequences(make_batch(ROWS5)))


def test_output_contract(baseline):
    out, B = baseline, 5
    t = out.batch
    assert t["prompts"].shape == (B, 128) and t["prompts"].dtype == torch.int64
    assert t["attention_mask"].shape == (B, 128) and t["attention_mask"].sum(1).min() > 0
    assert t["responses"].shape == (B, 3, 64, 64) and t["responses"].dtype == torch.uint8
    W = t["rollout_log_probs"].shape[1]
    assert t["rollout_log_probs"].dtype == torch.float32 and W == 2
    assert t["all_latents"].shape[:2] == (B, W + 1) and t["all_latents"].dtype == torch.float32
    for k in ("all_timesteps", "sigmas", "sigmas_next"):
        assert t[k].shape == (B, W)
    assert t["prompt_embeds"].shape[:2] == t["prompt_embeds_mask"].shape == (B, 93)
    assert "negative_prompt_embeds" in t.keys() and "negative_pooled_prompt_embeds" in t.keys()
    assert t["pooled_prompt_embeds"].shape[0] == B and t["sde_window"].shape == (B, 2)
    assert "rm_scores" not in t.keys()  # no reward workers
    nt = out.non_tensor_batch
    assert list(nt["status"]) == ["ok"] * B and list(nt["weight_version"]) == [0] * B
    assert list(nt["_group_index"]) == [0, 1, 0, 1, 0] and len(set(nt["seed"])) == B
    assert list(nt["__num_turns__"]) == [2] * B
    assert len(out.meta_info["metrics"]) == B and out.meta_info["min_weight_version"] == 0
    assert all(m["generate_sequences"] > 0 for m in out.meta_info["metrics"])
    # the two chat forms of u1 extract the same user text
    assert torch.equal(t["prompt_embeds"][2], t["prompt_embeds"][3])


def _same(a, b, rows=None):
    rows = list(range(len(a))) if rows is None else rows
    for k in ("responses", "all_latents", "rollout_log_probs", "prompt_embeds"):
        assert torch.equal(a.batch[k][rows], b.batch[k]), k
    assert list(a.non_tensor_batch["seed"][rows]) == list(b.non_tensor_batch["seed"])


def test_same_images_with_two_replicas_and_two_workers(cfg, replicas, baseline, ray_cluster):
    """One and two workers draw the baseline's images. A worker holds the replicas' handles, so Ray loads their actor
    class (omniroll.rollout.replica) in it; it imports neither PEFT nor transformers (~3 s of every worker's start)."""
    for workers in (1, 2):
        mgr = AgentLoopManager(cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"num_workers": workers})}),
                               replicas)
        try:
            out = mgr.generate_sequences(make_batch(ROWS5))
            loaded = ray_cluster.get(mgr.workers[0].__ray_call__.remote(
                lambda self: sorted(m for m in ("omniroll.rollout.replica", "peft", "transformers")
                                    if m in __import__("sys").modules)))
        finally:
            mgr.shutdown()
        assert loaded == ["omniroll.rollout.replica"]
        _same(baseline, out)
        assert list(out.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1", "u2"]
        assert len(out.meta_info["metrics"]) == 5 and "timing" in out.meta_info


def test_the_only_agent_loop_worker_lost_mid_batch_is_restarted_and_its_chunk_rerun(cfg, replicas, baseline,
                                                                                    ray_cluster):
    """The one agent-loop worker's process is lost while its rows generate (as when its node leaves): Ray restarts
    it, the manager re-runs its chunk there (new engine request ids), and the samples are the unfailed run's. The
    replicas pause after one step until the kill: polling alone once saw the batch finish first on a busy machine."""
    mgr = AgentLoopManager(cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"num_workers": 1})}), replicas)

    async def go():
        for r in replicas:
            ray_cluster.get(r.pause_generation.remote(after_steps=1, timeout_s=120))
        task = asyncio.ensure_future(mgr.generate_sequences_async(make_batch(ROWS5)))
        while sum(ray_cluster.get(r.stats.remote())["running"] for r in replicas) == 0:
            assert not task.done()
            await asyncio.sleep(0.02)
        ray_cluster.kill(mgr.workers[0], no_restart=False)  # its process dies; Ray restarts it
        for r in replicas:
            ray_cluster.get(r.resume_generation.remote())
        return await task

    try:
        out = asyncio.run(go())
    finally:
        mgr.shutdown()
        for r in replicas:  # paused replicas would hold the module's next tests
            ray_cluster.get(r.resume_generation.remote())
    _same(baseline, out)
    assert list(out.non_tensor_batch["request_id"]) == list(baseline.non_tensor_batch["request_id"])


def test_seeds_do_not_depend_on_chunking(cfg, replicas, baseline):
    full = AgentLoopManager.prepare(make_batch(ROWS5))
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas))
    part = asyncio.run(worker.generate_sequences(full[[1, 3, 4]]))
    _same(baseline, part, rows=[1, 3, 4])


def test_replica_killed_mid_batch(cfg, replicas, tiny_sd3_path, ray_cluster):
    """The victim pauses after one step, so it holds requests when the other has served (polling alone saw the batch
    finish first on a busy machine); killed then, its requests rerun elsewhere and every sample is the reference's."""
    rows = [(f"k{i}", f"a small {c} house") for i, c in enumerate(["red", "blue", "green", "pink", "gray", "gold"])]
    rows = rows + rows  # two samples per uid
    ref = asyncio.run(DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1])).generate_sequences(make_batch(rows)))
    victim = create_replicas(1, tiny_sd3_path, {"max_batch_size": 2}, num_cpus=0)[0]
    ray_cluster.get(victim.health.remote())  # started: it takes its share of the batch from the first request on
    ray_cluster.get(victim.pause_generation.remote(after_steps=1, timeout_s=120))
    client = RolloutClient([victim, replicas[1]], timeout_s=60, unhealthy_s=60)

    async def go():
        task = asyncio.create_task(DiffusionAgentLoopWorker(cfg, client).generate_sequences(make_batch(rows)))
        deadline = time.monotonic() + 120
        while client.in_flight[0] == 0 or client.served[1] == 0:  # requests in flight on the victim, others served
            assert not task.done() and time.monotonic() < deadline, (
                f"the victim never held a request while the other replica served (in flight {client.in_flight}, "
                f"served {client.served}): nothing to kill")
            await asyncio.sleep(0.005)
        ray_cluster.kill(victim, no_restart=True)  # with requests in flight there
        return await task

    out = asyncio.run(go())
    assert len(out) == len(rows) and list(out.non_tensor_batch["status"]) == ["ok"] * len(rows)
    _same(ref, out)
    attempts = list(out.non_tensor_batch["rollout_attempts"])
    assert max(attempts) == 2 and 0 in client.stats()["dead"]
    assert len(set(out.non_tensor_batch["request_id"])) == len(rows)


def test_streaming_rewards(cfg, replicas, ray_cluster):
    from omniroll.reward import create_reward_workers

    handles = create_reward_workers({"jpeg": {"fn": "jpeg_compressibility"}}, 2, num_cpus=0)
    ray_cluster.get([h.ping.remote() for h in handles])  # started, so scoring latency is not actor start-up
    try:
        rows = [(f"r{i}", f"a {w} bird") for i, w in enumerate(["red", "blue", "green", "pink", "gray", "gold",
                                                                  "black", "white"])]
        worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]), reward_loop_worker_handles=handles)
        out = asyncio.run(worker.generate_sequences(make_batch(rows)))
    finally:
        for h in handles:
            ray_cluster.kill(h)
    rm = out.batch["rm_scores"]
    assert rm.shape == (8, 1) and rm.dtype == torch.float32 and torch.isfinite(rm).all()
    assert out.meta_info["reward_extra_keys"] == ["jpeg"]
    assert np.allclose(np.array(out.non_tensor_batch["jpeg"], dtype=float), rm[:, 0].numpy())
    infos = out.non_tensor_batch["reward_extra_info"]
    last_generated = max(m["generate_finished_at"] for m in out.meta_info["metrics"])
    assert min(i["started_at"] for i in infos) < last_generated  # early samples scored while others generate
    assert all(m["compute_score"] > 0 for m in out.meta_info["metrics"])


def test_bad_inputs_fail_alone(tiny_sd3_path, replicas, baseline):
    rows = [dict(uid="u0", raw_prompt="a red cat"), dict(uid="bad0", raw_prompt=None),
            dict(uid="bad1", raw_prompt="a cat", sampling_params={"height": 8}),
            dict(uid="bad2", raw_prompt="a cat", sampling_params={"max_sequence_length": 32}),
            dict(uid="bad3", raw_prompt="a cat", agent_name="nope"),
            dict(uid="u2", raw_prompt="a green tree")]
    cfg = cfg_for(tiny_sd3_path, max_prompt_embed_length=100)
    client = RolloutClient(replicas[:1])
    with pytest.raises(AgentLoopError) as ei:
        asyncio.run(DiffusionAgentLoopWorker(cfg, client).generate_sequences(make_batch(rows)))
    msg = str(ei.value)
    assert "4 of 6 rows failed" in msg and [f["row"] for f in ei.value.failed_rows] == [1, 2, 3, 4]
    for needle in ("raw_prompt", "sampling_params.height", "max_prompt_embed_length", "diffusion_single_turn_agent"):
        assert needle in msg, needle
    marked = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"on_failure": "mark"})})
    out = asyncio.run(DiffusionAgentLoopWorker(marked, client).generate_sequences(make_batch(rows)))
    assert list(out.non_tensor_batch["status"]) == ["ok", "failed", "failed", "failed", "failed", "ok"]
    assert out.batch["failed"].tolist() == [False, True, True, True, True, False]
    assert out.batch["responses"][1:5].sum() == 0 and out.non_tensor_batch["error"][0] is None
    # the good rows are exactly what they are without the bad ones (embeds: baseline Lmax 93 vs 100 here)
    assert torch.equal(out.batch["responses"][[0, 5]], baseline.batch["responses"][[0, 4]])
    assert torch.equal(out.batch["prompt_embeds"][[0, 5], :93], baseline.batch["prompt_embeds"][[0, 4]])


def test_batch_level_errors(cfg, replicas):
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]))
    with pytest.raises(ValueError, match="raw_prompt"):
        asyncio.run(worker.generate_sequences(DataBatch.from_dict(non_tensors={"uid": ["a"]},
                                                                  meta_info={"global_steps": 1})))
    with pytest.raises(ValueError, match="global_steps"):
        asyncio.run(worker.generate_sequences(DataBatch.from_dict(non_tensors={"raw_prompt": ["a"]})))
    with pytest.raises(ValueError, match="meta_info.sampling_params.noise_level"):
        asyncio.run(worker.generate_sequences(make_batch([("a", "x")], sampling_params={"noise_level": -1})))
    with pytest.raises(ValueError, match=r"meta_info\['sampling_params'\]\.height must be a positive multiple of "
                                         r"16 .*got 72 \(nothing was sent\)"):  # the engine's check, before any call
        asyncio.run(worker.generate_sequences(make_batch([("a", "x"), ("b", "y")], sampling_params={"height": 72})))
    assert sum(worker.client.served) == 0
    with pytest.raises(ValueError, match="same \\(uid, _group_index\\)"):
        asyncio.run(worker.generate_sequences(make_batch([{"uid": "a", "raw_prompt": "x", "_group_index": 0}] * 2)))


def test_validation_is_ode_without_logprobs(cfg, replicas):
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]))
    b = make_batch([("v0", "a red cat"), ("v0", "a red cat")], global_steps=5, validate=True)
    out1 = asyncio.run(worker.generate_sequences(b))
    out2 = asyncio.run(worker.generate_sequences(make_batch([("v0", "a red cat")] * 2, global_steps=9, validate=True)))
    assert "rollout_log_probs" not in out1.batch.keys() and out1.batch["noise_level"].tolist() == [0.0, 0.0]
    assert out1.non_tensor_batch["seed"][0] != out1.non_tensor_batch["seed"][1]  # one seed per row
    assert torch.equal(out1.batch["responses"], out2.batch["responses"])  # the same validation images every step


def test_rows_that_cannot_share_the_batch_are_refused_before_generation(cfg, replicas):
    rows = [dict(uid="u0", raw_prompt="a red cat"),
            dict(uid="h", raw_prompt="a cat", sampling_params={"height": 128}),
            dict(uid="w", raw_prompt="a cat", sampling_params={"sde_window_size": 1}),  # 1 recorded step, batch: 2
            dict(uid="c", raw_prompt="a cat", sampling_params={"guidance_scale": 1.0}),  # CFG off
            dict(uid="l", raw_prompt="a cat", sampling_params={"logprobs": False}),
            dict(uid="ok", raw_prompt="a cat", sampling_params={"noise_level": 0.3, "max_sequence_length": 8})]
    client = RolloutClient(replicas[:1])
    with pytest.raises(AgentLoopError) as ei:
        asyncio.run(DiffusionAgentLoopWorker(cfg, client).generate_sequences(make_batch(rows)))
    assert sum(client.served) == 0  # nothing was generated
    assert [f["row"] for f in ei.value.failed_rows] == [1, 2, 3, 4] and ei.value.batch is None
    msg = str(ei.value)
    assert "4 of 6 rows failed before generation (nothing was generated)" in msg
    for field in ("sampling_params.height gives height=128 where the batch has 64",
                  "sampling_params.sde_window_size gives recorded_steps=1 where the batch has 2",
                  "sampling_params.guidance_scale gives cfg=False", "sampling_params.logprobs gives logprobs=False"):
        assert field in msg, field
    marked = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"on_failure": "mark"})})
    out = asyncio.run(DiffusionAgentLoopWorker(marked, client).generate_sequences(make_batch(rows)))
    assert sum(client.served) == 2  # only the rows that fit were generated
    assert list(out.non_tensor_batch["status"]) == ["ok", "failed", "failed", "failed", "failed", "ok"]
    assert out.batch["responses"].shape == (6, 3, 64, 64) and out.batch["rollout_log_probs"].shape == (6, 2)
    assert "sampling_params.height" in out.non_tensor_batch["error"][1]


def test_prompt_length_is_checked_at_config_load(tiny_sd3_path):
    from omniroll.config import ConfigError

    for model in ("tiny", tiny_sd3_path):
        with pytest.raises(ConfigError, match="prompt_length: must be >= 77: the model's tokenizer pads prompt ids"):
            cfg_for(tiny_sd3_path, engine={"model": model}, prompt_length=76)
    assert cfg_for(tiny_sd3_path, prompt_length=77).prompt_length == 77


def test_prompt_ids_longer_than_prompt_length_fail_their_row_not_the_batch(cfg, replicas):
    """For a model the config load cannot look into (model_copy skips validation here), the row fails alone after
    generation, naming prompt_length, instead of the whole batch failing at stacking."""
    short = cfg.model_copy(update={"prompt_length": 64})
    with pytest.raises(AgentLoopError, match=r"77 token ids .*more than prompt_length=64") as ei:
        asyncio.run(DiffusionAgentLoopWorker(short, RolloutClient(replicas[:1])).generate_sequences(
            make_batch([("p0", "a red cat")])))
    assert [f["row"] for f in ei.value.failed_rows] == [0] and ei.value.batch is None


def test_agent_loop_error_carries_the_rows_that_succeeded(cfg, replicas, baseline, ray_cluster):
    """Raise mode over two workers: one row fails; the error still carries the five good rows, assembled and merged
    across chunks, identical to the batch without the bad row. A row that cannot share the batch is refused before
    any chunk is sent."""
    rows = ROWS5[:2] + [dict(uid="bad", raw_prompt=None)] + ROWS5[2:]
    mgr = AgentLoopManager(cfg, replicas)
    try:
        with pytest.raises(AgentLoopError) as ei:
            mgr.generate_sequences(make_batch(rows))
        served = sum(ray_cluster.get(r.stats.remote())["served"] for r in replicas)
        with pytest.raises(AgentLoopError, match="row 1 .*sampling_params.width gives width=128"):
            mgr.generate_sequences(make_batch([("a", "x"), {"uid": "b", "raw_prompt": "y",
                                                            "sampling_params": {"width": 128}}]))
        with pytest.raises(ValueError, match=r"meta_info\['sampling_params'\]\.width must be a positive multiple"):
            mgr.generate_sequences(make_batch([("a", "x")], sampling_params={"width": 40}))
        assert sum(ray_cluster.get(r.stats.remote())["served"] for r in replicas) == served
    finally:
        mgr.shutdown()
    err = ei.value
    assert [f["row"] for f in err.failed_rows] == [2] and "raw_prompt is missing" in str(err)
    assert err.succeeded_rows == [0, 1, 3, 4, 5] and len(err.batch) == 5
    _same(err.batch, baseline)
    assert list(err.batch.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1", "u2"]
    assert "5 row(s) succeeded: AgentLoopError.batch holds them" in str(err)


def test_same_latent_groups_share_initial_noise_and_window(tiny_sd3_path, replicas):
    cfg = cfg_for(tiny_sd3_path, algo={"same_latent": True, "sde_window_size": 1, "sde_window_range": (1, 3)})
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]))
    rows = [("u0", "a red cat")] * 3 + [("u1", "a red cat")] * 2
    out = asyncio.run(worker.generate_sequences(make_batch(rows, global_steps=4)))
    lat, win = out.batch["all_latents"], out.batch["sde_window"].tolist()
    assert len(set(out.non_tensor_batch["seed"])) == 5  # every sample keeps its own seed (window noise)
    for group in ([0, 1, 2], [3, 4]):
        assert all(torch.equal(lat[group[0], 0], lat[i, 0]) and win[i] == win[group[0]] for i in group)
        assert not torch.equal(lat[group[0], 1], lat[group[1], 1])
    assert not torch.equal(lat[0, 0], lat[3, 0])  # another group (uid), another initial noise


def test_reward_worker_killed_mid_batch_every_row_scored(cfg, replicas, ray_cluster):
    """One of two reward workers dies while it scores: its samples are re-scored on the other, no row fails."""
    from omniroll.reward import create_reward_workers
    from tests.test_reward_worker import _actor_options

    functions = {"jpeg": {"fn": "jpeg_compressibility"},
                 "slow": {"fn": "tests.reward_fns:slow_async", "kwargs": {"delay": 1.0}, "weight": 0.0}}
    handles = create_reward_workers({"functions": functions, "max_wait_ms": 20}, 2, num_cpus=0, **_actor_options())
    ray_cluster.get([h.ping.remote() for h in handles])
    rows = [(f"k{i}", f"a {w} boat") for i, w in enumerate(["red", "blue", "green", "pink", "gray", "gold"])]
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]), reward_loop_worker_handles=handles)

    async def go():
        task = asyncio.create_task(worker.generate_sequences(make_batch(rows)))
        for _ in range(600):  # until worker 0 is scoring (bounded)
            if ray_cluster.get(handles[0].stats.remote())["batches"] >= 1:
                break
            await asyncio.sleep(0.02)
        ray_cluster.kill(handles[0], no_restart=True)
        return await task

    try:
        out = asyncio.run(go())
    finally:
        ray_cluster.kill(handles[1], no_restart=True)
    assert list(out.non_tensor_batch["status"]) == ["ok"] * len(rows)
    assert out.batch["rm_scores"].shape == (len(rows), 1) and torch.isfinite(out.batch["rm_scores"]).all()
    assert worker.reward_pool.stats()["dead"] == [0] and worker.reward_pool.stats()["rescored"] >= 1


def test_tree_groups_name_their_leaves_and_each_leaf_is_its_unshared_run(tiny_sd3_path, replicas):
    """`algo.tree`: each prompt group is a tree; every row names its node path and its trajectory is, bitwise, the
    same request's run alone on an engine without prefix sharing (pixels too, in tests/test_tree_rollout.py: here the
    replica's decode settings differ from a local engine's)."""
    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine

    cfg = cfg_for(tiny_sd3_path, n=4, pipeline={**PIPE, "num_inference_steps": 6},
                  algo={"tree": {"fork_steps": [2, 4], "widths": [2, 2]}})
    worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas[:1]))
    rows = [("u0", "a red cat")] * 4 + [("u1", "a blue dog")] * 4
    batch = make_batch(rows, global_steps=2)
    out = asyncio.run(worker.generate_sequences(batch))
    nt = out.non_tensor_batch
    assert [list(p) for p in nt["tree_path"]] == [[0, 0], [0, 1], [1, 0], [1, 1]] * 2
    assert len(set(nt["seed"][:4])) == 1 and nt["seed"][0] != nt["seed"][4]  # the root's noise seed, per tree
    plan = worker.plan(batch)
    alone = DiffusionEngine.from_pretrained(tiny_sd3_path, prefix_sharing=False)
    try:
        for i, f in enumerate(plan):
            sp = SamplingParams(**{**cfg.sampling_params(), "latent_seed": f["latent_seed"],
                                   "noise_seeds": f["noise_seeds"]})
            ref = alone.generate([GenerationRequest(request_id=f"ref{i}", prompt=f["raw_prompt"], seed=f["seed"],
                                                    sampling_params=sp)])[0]
            assert torch.equal(out.batch["all_latents"][i], ref.extra_fields["all_latents"])
            assert torch.equal(out.batch["rollout_log_probs"][i], ref.log_probs)
            assert torch.equal(out.batch["sigmas"][i], ref.extra_fields["sigmas"])
    finally:
        alone.shutdown()
    lat = out.batch["all_latents"]  # siblings: one path up to their fork, then apart
    assert torch.equal(lat[0, :5], lat[1, :5]) and not torch.equal(lat[0, 5], lat[1, 5])
    assert torch.equal(lat[0, :3], lat[2, :3]) and not torch.equal(lat[0, 3], lat[2, 3])
    with pytest.raises(ValueError, match=r"algo.tree.fork_steps\[1\]: step 4 is outside the schedule"):
        asyncio.run(worker.generate_sequences(make_batch(rows, global_steps=2,
                                                         sampling_params={"num_inference_steps": 4})))
