"""The asynchronous trainer (the trainer side; its objective's pure pieces: test_train_objective.py):
max_staleness 0 through the decoupled path equals today's synchronous path bitwise (weights and
metrics); with max_staleness 1 the rollout of step t+1 runs while step t trains, every sample is exactly one version
old, the behaviour replay and the proximal ratio are exact, and a Ctrl-C'd run resumes to the same weights bitwise;
a replica killed mid-rollout has its samples re-run with the same seeds and versions (the run equals one without the
kill bitwise); the rollout pipeline's waiting hold; the staleness bookkeeping."""

import asyncio
import gc
import json
import os
import threading
import time
import warnings

import pytest
import torch

from omniroll.agent_loop.batch import DataBatch
from omniroll.config import ConfigError, load_config
from omniroll.train.async_rollout import RolloutPipeline, overlap_seconds
from omniroll.train.staleness import stale_rows, staleness_stats, step_versions

from test_train import lora_weights, train_config

TIMING = {"rollout_s", "reward_wait_s", "rollout_wait_s", "train_s", "sync_s", "step_s", "overlap_frac",
          "samples_per_s", "policy_move_s", "recompute_s"}


def _batch(versions=None, weight_version=None):
    nt = {"uid": ["a"] * 3}
    if versions is not None:
        nt["step_weight_versions"] = versions
    if weight_version is not None:
        nt["weight_version"] = weight_version
    return DataBatch.from_dict(non_tensors=nt)


def test_step_versions_staleness_and_overlap_bookkeeping():
    # without the engine's per-step versions, each sample's weight_version for every window step
    assert step_versions(_batch(weight_version=[3, 2, 3]), 2).tolist() == [[3, 3], [2, 2], [3, 3]]
    v = step_versions(_batch(versions=[[1, 2], [2, 2], [0, 1]], weight_version=[1, 2, 0]), 2)
    assert v.tolist() == [[1, 2], [2, 2], [0, 1]]
    with pytest.raises(ValueError, match="2 entries"):
        step_versions(_batch(versions=[[1], [2], [0]]), 2)
    with pytest.raises(ValueError, match="no weight versions"):
        step_versions(_batch(), 2)
    assert staleness_stats(v, 2) == {"staleness_min": 0, "staleness_mean": pytest.approx(4 / 6), "staleness_max": 2,
                                     "version_span_max": 1}
    assert stale_rows(v, 2, 1) == [2] and stale_rows(v, 2, 2) == []
    assert overlap_seconds([(0, 2), (1, 3), (5, 6)], [(2.5, 5.5)]) == pytest.approx(1.0)
    assert overlap_seconds([], [(0, 1)]) == 0.0


def test_rollout_pipeline_runs_in_order_holds_for_a_waiting_sync_and_discards():
    log = []

    async def generate(step):
        log.append(("start", step, time.time()))
        await asyncio.sleep(0.2)
        log.append(("end", step, time.time()))
        return step * 10

    pipe = RolloutPipeline(generate, rows_per_batch=4)
    try:
        pipe.submit(1)
        pipe.submit(2)
        time.sleep(0.05)
        with pipe.held():  # entered once batch 1 has finished; batch 2 does not start inside
            entered = time.time()
            time.sleep(0.1)
            assert [e[:2] for e in log] == [("start", 1), ("end", 1)]
        assert entered >= log[1][2]
        assert pipe.take(1) == 10 and pipe.take(2) == 20
        assert [e[:2] for e in log] == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
        assert log[2][2] >= entered + 0.1
        busy = pipe.busy(log[0][2], log[-1][2])
        assert sum(b - a for a, b in busy) == pytest.approx(0.4, abs=0.05)
        pipe.submit(3)
        pipe.submit(4)
        assert pipe.discard() == 8 and pipe.in_flight() == []
    finally:
        pipe.close()


def test_discard_ends_every_batch_even_one_cancelled_before_it_started():
    """A batch cancelled before its turn (queued behind another) still ends on the loop: nothing is left pending
    when the loop closes, so no "coroutine RolloutPipeline._run was never awaited" warning."""
    async def generate(step):
        await asyncio.sleep(5)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = RolloutPipeline(generate, rows_per_batch=2)
        for step in (1, 2, 3):
            pipe.submit(step)
        assert pipe.discard() == 6 and pipe.in_flight() == []
        pipe.close()
        del pipe
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


def test_async_options_are_validated():
    base = {"reward": {"functions": {"c": {"fn": "prompt_colour"}}}, "n": 2,
            "trainer": {"prompts": ["a red car"], "prompts_per_step": 1}}
    for key, value, allowed in (("max_staleness", -1, "greater than or equal to 0"),
                                ("on_stale", "skip", "'drop' or 'wait'"),
                                ("old_log_prob", "actor", "'rollout' or 'recompute'"),
                                ("behaviour_weight_cap", 0.5, "greater than or equal to 1")):
        with pytest.raises(ConfigError, match=f"trainer.{key}") as e:
            load_config({**base, "trainer": {**base["trainer"], key: value}})
        assert allowed in str(e.value)
    cfg = load_config(base)
    assert (cfg.trainer.max_staleness, cfg.trainer.partial_rollout, cfg.trainer.on_stale, cfg.trainer.old_log_prob,
            cfg.trainer.behaviour_weight_cap) == (0, False, "drop", "rollout", 2.0)


def test_stale_samples_are_dropped_and_counted_and_unknown_versions_refused(tiny_sd3_path, tmp_path):
    from omniroll.train import Trainer, WeightVersionError

    tr = Trainer(train_config(tiny_sd3_path, max_staleness=1), str(tmp_path / "o"), log=lambda s: None)
    tr.version = 5
    batch = DataBatch.from_dict(tensors={"rollout_log_probs": torch.zeros(4, 2)}, non_tensors={
        "request_id": ["r0", "r1", "r2", "r3"], "weight_version": [4, 3, 5, 4],
        "step_weight_versions": [[4, 5], [3, 4], [5, 5], [4, 4]]})
    out, versions, counts = tr._fresh(7, batch)  # r1 ran a step with version 3 < 5 - 1
    assert list(out.non_tensor_batch["request_id"]) == ["r0", "r2", "r3"]
    assert versions.tolist() == [[4, 5], [5, 5], [4, 4]] and counts == {"stale_dropped": 1, "stale_regenerated": 0}
    tr.version = 4  # r0 and r2 ran steps with version 5, which this trainer never pushed
    with pytest.raises(WeightVersionError, match=r"step 7: 2 sample\(s\) .* never pushed \(trainer at version 4\)"):
        tr._fresh(7, batch)


def _run(cfg, out, steps, on_step=None, after=None):
    from omniroll.train import Trainer

    with Trainer(cfg, out, log=lambda s: None) as tr:
        try:
            tr.train(steps, on_step=on_step)
        except KeyboardInterrupt:
            pass
        if after is not None:
            after(tr)
        return tr.discarded_samples


def _metrics(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def test_staleness_0_through_the_decoupled_objective_equals_the_synchronous_path_bitwise(
        ray_cluster, tiny_sd3_path, tmp_path):
    """3 steps of today's synchronous path (max_staleness 0, the behaviour is the recorded log-prob and the PPO
    anchor) against 3 steps through the decoupled objective (behaviour recomputed, proximal anchor, importance weight):
    identical weights and metrics, bitwise."""
    sync, dec = str(tmp_path / "sync"), str(tmp_path / "decoupled")

    def failing_sync(tr):  # a sync the replica refuses (it already holds a later version) fails loudly, naming it
        tr.sender.send(tr.policy.weights_to_send(), version=tr.version + 5)
        tr.store.record(4)  # as step 4 would after its update
        with pytest.raises(WeightVersionError, match="weight sync to version 4 failed: .*WeightSyncError"):
            tr._sync(4)
        assert tr.version == 3

    from omniroll.train import WeightVersionError

    _run(train_config(tiny_sd3_path, steps=3), sync, 3, after=failing_sync)
    _run(train_config(tiny_sd3_path, steps=3, old_log_prob="recompute"), dec, 3)
    a, b = lora_weights(os.path.join(sync, "checkpoints", "step_000003")), \
        lora_weights(os.path.join(dec, "checkpoints", "step_000003"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = _metrics(sync), _metrics(dec)
    assert [{k: v for k, v in m.items() if k not in TIMING} for m in ma] == \
        [{k: v for k, v in m.items() if k not in TIMING} for m in mb]
    assert [m["behaviour_replay_max_abs_dev"] for m in ma + mb] == [0.0] * 6
    assert all(m["staleness_max"] == 0 and m["stale_dropped"] == 0 for m in ma)


def test_staleness_1_overlaps_is_exact_and_a_ctrl_c_resume_equals_the_straight_run_bitwise(
        ray_cluster, tiny_sd3_path, tmp_path):
    cfg = train_config(tiny_sd3_path, steps=4, max_staleness=1, checkpoint_every=1)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    _run(cfg, straight, 4)
    hist = _metrics(straight)
    # batch t is generated with version t-2 (t >= 2) while step t-1 trains: exactly one version old
    assert [m["weight_version"] for m in hist] == [0, 0, 1, 2]
    assert [m["staleness_max"] for m in hist] == [0, 1, 1, 1] and all(m["stale_dropped"] == 0 for m in hist)
    assert all(m["behaviour_replay_max_abs_dev"] == 0.0 and m["prox_ratio_max_abs_dev"] == 0.0 for m in hist)
    assert all(m["version_span_max"] == 0 for m in hist)

    def interrupt(m):
        if m["step"] == 2:
            raise KeyboardInterrupt

    discarded = _run(cfg, resumed, 4, on_step=interrupt)
    assert discarded == 8  # batch 3 (2 prompts x 4) was in flight
    from omniroll.train import Trainer

    with Trainer(cfg, resumed, resume=resumed, log=lambda s: None) as tr:
        with pytest.raises(ValueError, match=r"regenerated the in-flight batches up to trainer.steps 4; set "
                                             r"trainer.steps=2"):
            tr.train(2)  # start() regenerated batch 3 (in flight at step 2's checkpoint), which 2 steps never take
        tr.train(4)
    a = lora_weights(os.path.join(straight, "checkpoints", "step_000004"))
    b = lora_weights(os.path.join(resumed, "checkpoints", "step_000004"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = _metrics(straight), _metrics(resumed)
    assert [{k: v for k, v in m.items() if k not in TIMING} for m in ma] == \
        [{k: v for k, v in m.items() if k not in TIMING} for m in mb]


def test_log_probs_under_versions_rescore_each_window_step_under_its_own_version(tiny_sd3_path):
    """The version store swaps exact copies of older weights in and out: samples generated at versions 0 and 1 are
    rescored bitwise under their own versions, a step assigned to another version is scored under that one (a sample
    that spans a sync), and the policy ends with its current weights."""
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
    from omniroll.train import TrajectoryBatch, recompute_log_probs
    from omniroll.train.behaviour_log_probs import log_probs_under_versions
    from omniroll.train.version_store import VersionStore
    from omniroll.train.policy import Policy
    from omniroll.weights import WeightSender

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    try:
        policy = Policy(tiny_sd3_path, "lora", rank=4, alpha=8.0)
        store = VersionStore(policy, keep=1)
        store.record(0)
        sp = SamplingParams(height=32, width=32, num_inference_steps=4, max_sequence_length=8, noise_level=1.0,
                            sde_window_size=2, sde_window_range=(0, 3))

        def generate(version):
            return engine.generate([GenerationRequest(request_id=f"v{version}-{i}", prompt="a blue car", seed=i,
                                                      sampling_params=sp) for i in range(2)])

        outs = generate(0)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        store.record(1)
        WeightSender([engine]).send(policy.weights_to_send(), version=1)
        outs += generate(1)
        traj = TrajectoryBatch.from_outputs(outs)
        assert traj.weight_version == [0, 0, 1, 1]
        current = [p.detach().clone() for p in policy.parameters()]
        own = torch.tensor([[0, 0], [0, 0], [1, 1], [1, 1]])
        assert torch.equal(log_probs_under_versions(store, traj, own, micro_batch_size=3), traj.log_probs)
        spans = torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1]])  # no row runs version 0 at step 1
        lp = log_probs_under_versions(store, traj, spans, micro_batch_size=3)
        assert torch.equal(lp[:, 0], traj.log_probs[:, 0])
        with torch.no_grad():
            assert torch.equal(lp[:2, 1], recompute_log_probs(policy.adapter, traj.rows([0, 1]), 1).log_prob)
        assert not torch.equal(lp[:2, 1], traj.log_probs[:2, 1])
        assert all(torch.equal(p, c) for p, c in zip(policy.parameters(), current))
    finally:
        engine.shutdown()


def test_partial_rollout_samples_across_a_sync_are_replayed_exactly(ray_cluster, tiny_sd3_path, tmp_path):
    """With partial_rollout the sync lands between two denoise steps of the next batch (where it lands is timing):
    whatever versions each window step recorded, the replay under them and the proximal ratio are exact."""
    out = str(tmp_path / "partial")
    _run(train_config(tiny_sd3_path, steps=3, max_staleness=1, partial_rollout=True), out, 3)
    hist = _metrics(out)
    assert [m["behaviour_replay_max_abs_dev"] for m in hist] == [0.0] * 3
    assert [m["prox_ratio_max_abs_dev"] for m in hist] == [0.0] * 3
    assert all(m["staleness_max"] <= 1 and m["stale_dropped"] == 0 and m["partial_rollout"] for m in hist)



def test_a_replica_killed_during_an_async_rollout_reruns_its_samples_with_their_seeds_and_versions(
        ray_cluster, tiny_sd3_path, tmp_path):
    """max_staleness 1, partial_rollout false, 2 replicas, 3 steps. After step 1 the test arms a pause on replica 1
    after one denoising step: batch 3, generated with version 1 while step 2 trains, runs one step of its samples
    there and stops (a deterministic point, no timing); the test then kills that replica. The routing client re-runs
    those samples on the survivor (same request, same seed), the sync of version 2 (which waits for batch 3) drops the
    lost replica and completes on the survivor, and every step trains on the full batch with the versions the
    schedule dictates. Batch invariance makes the run, batch 3 included, bitwise equal to the run without the kill."""
    import ray

    from omniroll.config import load_config
    from omniroll.train import Trainer

    raw = train_config(tiny_sd3_path, steps=3, max_staleness=1).model_dump(mode="json")
    raw["replicas"].update(count=2, num_cpus=0.5)
    raw["n"] = 2  # the 2 prompts of train_config, 2 samples each: every batch holds both prompt groups
    cfg = load_config(raw)

    class Recording(Trainer):  # keeps every generated batch
        async def _rollout(self, step):
            out = await super()._rollout(step)
            self.batches[step] = out
            return out

    killed: dict = {}

    def kill_during_batch_3(tr):
        def on_step(m):
            if m["step"] != 1:
                return
            # batch 2 is back (the sync of version 1 waited for it); batch 3 is submitted when step 2 begins
            victim = tr.replicas[1]
            ray.get(victim.pause_generation.remote(after_steps=1, timeout_s=120))

            def kill():
                try:
                    killed["paused"] = ray.get(victim.wait_for_pause.remote(timeout_s=120))
                finally:
                    ray.kill(victim, no_restart=True)

            killed["thread"] = threading.Thread(target=kill, daemon=True)
            killed["thread"].start()
        return on_step

    def run(out, kill):
        logs: list = []
        with Recording(cfg, out, log=logs.append) as tr:
            tr.batches = {}
            tr.train(3, on_step=kill_during_batch_3(tr) if kill else None)
            return tr.batches, len(tr.replicas), logs

    base, faulted = str(tmp_path / "base"), str(tmp_path / "killed")
    ref_batches, ref_replicas, _ = run(base, kill=False)
    batches, survivors, logs = run(faulted, kill=True)
    killed["thread"].join(timeout=60)
    assert ref_replicas == 2 and survivors == 1
    assert sum("lost 1 replica(s)" in line for line in logs) == 1, logs
    paused = killed["paused"]  # killed mid-denoise: one step of batch 3's samples had run there
    assert paused["paused"] and paused["running"], paused

    hist = _metrics(faulted)
    assert [m["num_samples"] for m in hist] == [4, 4, 4]  # no sample lost
    assert [m["weight_version"] for m in hist] == [0, 0, 1] and [m["synced_version"] for m in hist] == [1, 2, 3]
    assert all(m["stale_dropped"] == 0 and m["behaviour_replay_max_abs_dev"] == 0.0
               and m["prox_ratio_max_abs_dev"] == 0.0 and m["version_span_max"] == 0 for m in hist)

    # the samples that ran on the killed replica (one prompt group) were re-run on the survivor, the others not
    b3 = batches[3].non_tensor_batch
    attempts = [int(a) for a in b3["rollout_attempts"]]
    rerun = [i for i, a in enumerate(attempts) if a > 1]
    assert sorted(attempts) == [1, 1, 2, 2], attempts
    assert set(paused["running"]) <= {b3["request_id"][i] for i in rerun}, (paused, list(b3["request_id"]))
    assert len({b3["uid"][i] for i in rerun}) == 1 and {int(i) for i in b3["replica_index"]} == {0}
    # versions: batch 3 ran every window step with version 1, re-runs included
    assert [int(v) for v in b3["min_weight_version"]] == [1] * 4 == [int(v) for v in b3["max_weight_version"]]
    assert [[int(x) for x in v] for v in b3["step_weight_versions"]] == [[1, 1]] * 4
    # same seeds: every batch, batch 3 included, is bitwise the one of the run without the kill
    for step in (1, 2, 3):
        a, b = batches[step], ref_batches[step]
        assert list(a.non_tensor_batch["request_id"]) == list(b.non_tensor_batch["request_id"])
        assert [[int(x) for x in v] for v in a.non_tensor_batch["step_weight_versions"]] == \
            [[int(x) for x in v] for v in b.non_tensor_batch["step_weight_versions"]]
        for k in ("responses", "rollout_log_probs", "all_latents", "rm_scores"):
            assert torch.equal(a.batch[k], b.batch[k]), (step, k)
    a = lora_weights(os.path.join(faulted, "checkpoints", "step_000003"))
    b = lora_weights(os.path.join(base, "checkpoints", "step_000003"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [{k: v for k, v in m.items() if k not in TIMING} for m in hist] == \
        [{k: v for k, v in m.items() if k not in TIMING} for m in _metrics(base)]
