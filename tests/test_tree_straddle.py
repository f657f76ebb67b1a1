"""A tree rollout whose leaves straddle a weight update (the asynchronous trainer's push lands while some leaves of a
tree are still queued on the replica) is re-run whole on one version by the agent loop, and a tree that straddles
again fails alone, each of its rows naming the versions: a real Ray replica of the tiny SD3, the in-process agent-loop
worker, real weight pushes placed by the engine's step pause (`pause_generation(after_steps=k)`, not by timing).

The replica's row budget holds one CFG sample (2 rows), so a tree of 4 leaves is larger than the budget and goes in
leaf by leaf (omniroll/engine/scheduler.py): every leaf runs its T = 4 steps alone, and the step counts below are
exact. A partial update after 2 steps lands in the first leaf to run; the tree's other leaves are admitted after it.
"""

import asyncio
import concurrent.futures as cf
import contextlib
import time

import pytest
import ray
import torch

from omniroll.agent_loop import AgentLoopError, DataBatch, DiffusionAgentLoopWorker
from omniroll.config import load_config
from omniroll.rollout import RolloutClient, create_replicas, kill_replicas
from omniroll.weights import WeightSender

T = 4  # denoising steps of every leaf
LEAVES = 4
PIPE = {"height": 32, "width": 32, "num_inference_steps": T, "guidance_scale": 4.5, "max_sequence_length": 8}
TREE = {"fork_steps": [1, 2], "widths": [2, 2]}
ROWS = [("u0", "a red cat")] * LEAVES + [("u1", "a blue dog")] * LEAVES


@pytest.fixture(scope="module")
def replica(ray_cluster, tiny_sd3_path):
    """One replica whose budget is one CFG sample, and the full weights it starts from."""
    from omniroll.models import load_adapter

    hs = create_replicas(1, tiny_sd3_path, {"max_batch_size": 2}, num_cpus=0)
    base = {k: v.detach().clone() for k, v in load_adapter(tiny_sd3_path).denoiser.state_dict().items()}
    yield hs[0], base
    kill_replicas(hs)


def config(tiny_sd3_path):
    return load_config({"engine": {"model": tiny_sd3_path, "max_batch_size": 2}, "pipeline": PIPE, "n": LEAVES,
                        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 3,
                                 "sde_window_range": [0, 3], "tree": TREE},
                        "agent": {"num_workers": 1}, "prompt_length": 128, "seed": 3, "timeout_s": 120})


def batch(step):
    nt = {"uid": [u for u, _ in ROWS], "raw_prompt": [p for _, p in ROWS], "data_source": ["test"] * len(ROWS)}
    return DataBatch.from_dict(non_tensors=nt, meta_info={"global_steps": step})


def push(h, base, version):
    """Full weights `base` moved by a seeded step, sent as `version`, landing between two denoising steps."""
    g = torch.Generator().manual_seed(version)
    sd = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    (ack,) = WeightSender([h], transport="ray").send(sd, version=version, partial=True)
    assert ack["version"] == version


def stats(h):
    return ray.get(h.stats.remote())


def paused_with_all_queued(h, queued):
    """The armed pause has begun with one leaf in flight, and `queued` more requests wait behind it."""
    info = ray.get(h.wait_for_pause.remote(120))
    deadline = time.time() + 30
    while stats(h)["queued"] < queued and time.time() < deadline:
        time.sleep(0.05)
    assert len(info["running"]) == 1 and stats(h)["queued"] == queued
    return info["running"][0]


@contextlib.contextmanager
def paused_after(h, steps):
    """Arm the replica's pause after `steps` denoising steps; a thread pool to generate in. On the way out the pause
    is lifted whatever happened, so a failed assertion never leaves the generating thread waiting on it."""
    ray.get(h.pause_generation.remote(after_steps=steps))
    with cf.ThreadPoolExecutor(1) as pool:
        try:
            yield pool
        finally:
            ray.get(h.resume_generation.remote())


def generate(worker, b):
    return asyncio.run(worker.generate_sequences(b))


def test_a_tree_that_straddles_an_update_runs_again_whole_on_one_version(replica, tiny_sd3_path):
    """The update lands after 2 of the first leaf's 4 steps: that leaf records (v0, v0, v1) in its window, the other
    leaves of its tree v1 only. The worker runs that tree again whole (its 4 leaves, ids `~tree1`), on v1; the other
    tree ran on v1 alone and is not run again. Every row comes back (8 of 8, none failed), every leaf row's weight
    versions are v1 at every step, and the rows are bitwise a plain run of the same batch on v1."""
    h, base = replica
    worker = DiffusionAgentLoopWorker(config(tiny_sd3_path), RolloutClient([h], timeout_s=120))
    v0 = stats(h)["weight_version"]
    v1 = v0 + 1
    before = stats(h)
    with paused_after(h, 2) as pool:
        future = pool.submit(generate, worker, batch(step=1))
        first = paused_with_all_queued(h, len(ROWS) - 1)
        push(h, base, v1)
        assert ray.get(h.resume_generation.remote())["resumed"]
        out = future.result(timeout=300)
    straddled = first.split("/")[2]  # request ids are {tag}/s{step}/{uid}/{index}
    nt = out.non_tensor_batch
    assert len(out) == len(ROWS) and [u for u, _ in ROWS] == list(nt["uid"])
    assert sorted(tuple(p) for p in nt["tree_path"][:LEAVES]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(nt["weight_version"]) == [v1] * len(ROWS)
    assert all(list(v) == [v1] * 3 for v in nt["step_weight_versions"])  # the window's 3 steps
    assert list(nt["tree_rerun"]) == [u == straddled for u, _ in ROWS]  # the rows say which tree ran again
    # the straddling tree ran twice (8 samples), the other once (4), each leaf every step (one CFG sample a forward)
    after = stats(h)
    assert after["served"] - before["served"] == 3 * LEAVES and straddled in ("u0", "u1")
    assert (after["steps"] - before["steps"], after["forward_rows"] - before["forward_rows"]) == (3 * LEAVES * T,
                                                                                                  3 * LEAVES * T * 2)
    # the same samples as a run of the same rows on v1 alone (same seeds): nothing of v0 is left in them
    again = generate(worker, batch(step=1))
    for k in ("all_latents", "rollout_log_probs"):
        assert torch.equal(out.batch[k], again.batch[k]), k
    assert list(again.non_tensor_batch["weight_version"]) == [v1] * len(ROWS)
    assert not any(again.non_tensor_batch["tree_rerun"])


def test_a_tree_that_straddles_twice_fails_alone_each_row_naming_the_versions(replica, tiny_sd3_path):
    """A second update lands 2 steps into the re-run's first leaf: the tree straddles again. Its 4 rows fail, each
    naming its uid and the versions; the other tree's 4 rows come back in the error's batch: nothing is lost silently,
    and no row of the failed tree is kept on mixed versions."""
    h, base = replica
    worker = DiffusionAgentLoopWorker(config(tiny_sd3_path), RolloutClient([h], timeout_s=120))
    v1 = stats(h)["weight_version"] + 1
    with paused_after(h, 2) as pool:
        future = pool.submit(generate, worker, batch(step=2))
        first = paused_with_all_queued(h, len(ROWS) - 1)
        push(h, base, v1)
        # the rest of the first pass (2 + 7 leaves x T steps), then 2 steps into the re-run's first leaf
        ray.get(h.pause_generation.remote(after_steps=T - 2 + (len(ROWS) - 1) * T + 2))
        rerun = paused_with_all_queued(h, LEAVES - 1)
        assert rerun.endswith("~tree1") and rerun.split("/")[2] == first.split("/")[2]
        push(h, base, v1 + 1)
        assert ray.get(h.resume_generation.remote())["resumed"]
        with pytest.raises(AgentLoopError) as err:
            future.result(timeout=300)
    e = err.value
    straddled = first.split("/")[2]
    failed = e.failed_rows
    assert sorted(f["row"] for f in failed) == [i for i, (u, _) in enumerate(ROWS) if u == straddled]
    for f in failed:
        assert f["uid"] == straddled and "ran on different weight versions" in f["error"] and "twice" in f["error"]
        assert f"[({v1}, ({v1}, {v1}, {v1 + 1})), ({v1 + 1}, ({v1 + 1}, {v1 + 1}, {v1 + 1}))]" in f["error"], f["error"]
    kept = e.batch
    assert len(kept) == LEAVES and set(kept.non_tensor_batch["uid"]) == {u for u, _ in ROWS} - {straddled}
    assert list(kept.non_tensor_batch["weight_version"]) == [v1] * LEAVES
    assert not any(kept.non_tensor_batch["tree_rerun"])  # the kept tree ran once
    assert sorted(e.succeeded_rows + [f["row"] for f in failed]) == list(range(len(ROWS)))
