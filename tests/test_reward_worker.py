"""RewardLoopWorker micro-batching (in-process and as a Ray actor) and RewardWorkerPool routing."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from omniroll.reward import (
    RewardLoopWorker,
    RewardPoolError,
    RewardSample,
    RewardWorkerPool,
    create_reward_workers,
)
from tests.reward_fns import make_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FNS = "tests.reward_fns"
RECORD = {"rec": {"fn": f"{FNS}:record_batch"}}


def _samples(n: int, prefix: str = "s") -> list[RewardSample]:
    return [RewardSample(f"{prefix}{i}", make_image(i), f"prompt {i}") for i in range(n)]


def _actor_options() -> dict:
    # Ray workers put the driver's cwd on sys.path; from anywhere else, ship the repo root explicitly.
    if os.path.abspath(os.getcwd()) == ROOT:
        return {}
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {"runtime_env": {"env_vars": {"PYTHONPATH": path}}}


# ------------------------------------------------------------------------------------------------ in-process
def test_in_process_micro_batches_and_routes_results():
    worker = RewardLoopWorker({"functions": {**RECORD, "bright": {"fn": f"{FNS}:mean_pixel", "weight": 0.0}},
                               "max_wait_ms": 20})

    async def go():
        return await asyncio.gather(*(worker.compute_score(s) for s in _samples(8)))

    results = asyncio.run(go())
    assert [r.sample_id for r in results] == [f"s{i}" for i in range(8)]
    # each caller got its own row (component computed from its own image)
    assert [r.components["bright"] for r in results] == pytest.approx([i / 255 for i in range(8)])
    stats = worker.stats()
    assert stats["batch_sizes"] == [8] and stats["batches"] == 1 and stats["samples"] == 8
    assert stats["status_counts"] == {"ok": 8, "flagged": 0, "failed": 0} and stats["in_flight"] == 0
    assert {r.extra_info["rec/batch_size"] for r in results} == {8}


def test_full_batches_flush_immediately_and_remainder_after_wait():
    worker = RewardLoopWorker(RECORD, max_batch_size=3, max_wait_ms=30)

    async def go():
        t0 = time.perf_counter()
        results = await asyncio.gather(*(worker.compute_score(s) for s in _samples(7)))
        return results, time.perf_counter() - t0

    results, elapsed = asyncio.run(go())
    assert sorted(worker.stats()["batch_sizes"]) == [1, 3, 3]
    assert [r.extra_info["rec/batch_size"] for r in results] == [3, 3, 3, 3, 3, 3, 1]
    assert elapsed >= 0.03  # the lone 7th sample waited for max_wait_ms
    assert worker.load() == 0


def test_single_sample_latency_is_bounded_by_max_wait():
    worker = RewardLoopWorker({"c": {"fn": f"{FNS}:const_one"}}, max_wait_ms=5)

    async def go():
        t0 = time.perf_counter()
        r = await worker.compute_score(_samples(1)[0])
        return r, time.perf_counter() - t0

    result, elapsed = asyncio.run(go())
    assert result.score == 1.0 and result.status == "ok" and elapsed < 1.0


def test_worker_reports_failures_as_rows_not_zeros():
    worker = RewardLoopWorker({"bad": {"fn": f"{FNS}:always_fail", "max_retries": 0}})

    async def go():
        return await worker.compute_scores(_samples(2))

    results = asyncio.run(go())
    assert all(r.status == "failed" and r.score is None for r in results)
    assert worker.stats()["status_counts"]["failed"] == 2


def test_scoring_overlaps_other_work_on_the_loop():
    """A slow *sync* scorer runs in a thread: the loop keeps 'generating' while rows are scored."""
    worker = RewardLoopWorker({"slow": {"fn": f"{FNS}:slow_sync", "kwargs": {"delay": 0.3}}}, max_wait_ms=1)

    async def go():
        scoring = asyncio.ensure_future(worker.compute_scores(_samples(4)))
        ticks = []
        while not scoring.done():  # stand-in for generation steps running concurrently
            ticks.append(time.time())
            await asyncio.sleep(0.01)
        return await scoring, ticks

    results, ticks = asyncio.run(go())
    assert all(r.score == 1.0 for r in results)
    started, finished = results[0].started_at, results[0].finished_at
    assert finished - started >= 0.3
    assert sum(started < t < finished for t in ticks) >= 5  # the loop was never blocked by the scorer


def test_cancelled_caller_does_not_disturb_others():
    worker = RewardLoopWorker(RECORD, max_wait_ms=30)

    async def go():
        tasks = [asyncio.ensure_future(worker.compute_score(s)) for s in _samples(4)]
        await asyncio.sleep(0)
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return done

    done = asyncio.run(go())
    assert isinstance(done[1], asyncio.CancelledError)
    assert [d.sample_id for i, d in enumerate(done) if i != 1] == ["s0", "s2", "s3"]
    assert worker.stats()["batch_sizes"] == [3] and worker.load() == 0


def test_worker_validates_inputs():
    with pytest.raises(ValueError, match="max_batch_size"):
        RewardLoopWorker(RECORD, max_batch_size=0)
    with pytest.raises(ValueError, match="worker_id must be an int >= 0"):
        RewardLoopWorker(RECORD, worker_id=-1)
    worker = RewardLoopWorker(RECORD)
    with pytest.raises(TypeError, match="expects a RewardSample"):
        asyncio.run(worker.compute_score({"sample_id": "x"}))


# --------------------------------------------------------------------------------------------------- pool
def test_pool_ties_round_robin_and_least_loaded_in_process():
    slow = RewardLoopWorker({"s": {"fn": f"{FNS}:slow_async", "kwargs": {"delay": 0.3}}}, worker_id=0, max_wait_ms=0)
    fast = RewardLoopWorker({"c": {"fn": f"{FNS}:const_one"}}, worker_id=1, max_wait_ms=0)
    pool = RewardWorkerPool([slow, fast])

    async def go():
        samples = _samples(4)
        first = asyncio.ensure_future(pool.score(samples[0]))  # tie -> worker 0 (slow)
        await asyncio.sleep(0)
        second = await pool.score(samples[1])  # worker 0 busy -> worker 1
        assert pool.load() == [1, 0]
        third = await pool.score(samples[2])  # least loaded is still worker 1
        assert pool.sent() == [1, 2]
        return await first, second, third

    first, second, third = asyncio.run(go())
    assert first.extra_info["s/attempts"] == 1 and second.score == third.score == 1.0
    assert pool.load() == [0, 0]

    # idle pool: consecutive requests alternate instead of always choosing the first worker
    pool2 = RewardWorkerPool([RewardLoopWorker(RECORD, worker_id=i, max_wait_ms=0) for i in range(3)])

    async def sequential():
        for s in _samples(6):
            await pool2.score(s)

    asyncio.run(sequential())
    assert pool2.sent() == [2, 2, 2]
    with pytest.raises(ValueError, match="at least one worker"):
        RewardWorkerPool([])
    with pytest.raises(TypeError, match="has no compute_score"):
        RewardWorkerPool([object()])


# ---------------------------------------------------------------------------------------------------- Ray
def test_ray_actor_micro_batches_concurrent_calls(ray_cluster):
    ray = ray_cluster
    (actor,) = create_reward_workers({"functions": RECORD, "max_wait_ms": 50}, 1, **_actor_options())
    assert ray.get(actor.ping.remote()) == 0
    samples = _samples(8)
    results = ray.get([actor.compute_score.remote(s) for s in samples])
    assert [r.sample_id for r in results] == [s.sample_id for s in samples]
    stats = ray.get(actor.stats.remote())
    assert sum(stats["batch_sizes"]) == 8 and 1 <= len(stats["batch_sizes"]) <= 2
    # the test scorer saw the same batches
    assert sorted(set(r.extra_info["rec/batch_size"] for r in results)) == sorted(set(stats["batch_sizes"]))
    assert all(r.status == "ok" and r.started_at <= r.finished_at for r in results)
    assert ray.get(actor.load.remote()) == 0
    ray.kill(actor)


def test_pool_spreads_load_over_two_actors(ray_cluster):
    ray = ray_cluster
    config = {"functions": {**RECORD, "bright": {"fn": f"{FNS}:mean_pixel"}}, "max_wait_ms": 20}
    actors = create_reward_workers(config, 2, **_actor_options())
    pool = RewardWorkerPool(actors)
    samples = _samples(8)

    async def go():
        return await pool.score_many(samples)

    results = asyncio.run(go())
    assert [r.sample_id for r in results] == [s.sample_id for s in samples]
    assert [r.components["bright"] for r in results] == pytest.approx([i / 255 for i in range(8)])
    assert pool.sent() == [4, 4] and pool.load() == [0, 0]
    per_actor = [ray.get(a.stats.remote())["samples"] for a in actors]
    assert per_actor == [4, 4]
    for a in actors:
        ray.kill(a)


def test_killed_worker_leaves_the_pool_and_its_samples_are_rescored(ray_cluster):
    """Kill one of two reward workers while it scores: every row is still scored (on the live one), the dead worker
    leaves the pool, and only when none is left does scoring fail, clearly."""
    ray = ray_cluster
    config = {"functions": {"slow": {"fn": f"{FNS}:slow_async", "kwargs": {"delay": 1.0}},
                            "bright": {"fn": f"{FNS}:mean_pixel"}}, "max_wait_ms": 20}
    actors = create_reward_workers(config, 2, **_actor_options())
    ray.get([a.ping.remote() for a in actors])
    pool = RewardWorkerPool(actors)
    samples = _samples(8)

    async def go():
        task = asyncio.ensure_future(pool.score_many(samples))
        for _ in range(200):  # until worker 0 is scoring its half (bounded)
            if ray.get(actors[0].stats.remote())["batches"] >= 1:
                break
            await asyncio.sleep(0.02)
        ray.kill(actors[0], no_restart=True)
        return await task

    results = asyncio.run(go())
    assert [r.sample_id for r in results] == [s.sample_id for s in samples]
    assert all(r.status == "ok" for r in results)
    assert [r.components["bright"] for r in results] == pytest.approx([i / 255 for i in range(8)])
    st = pool.stats()
    assert st["dead"] == [0] and st["live"] == 1 and st["rescored"] == 4 and pool.load() == [0, 0]
    assert pool.sent() == [4, 8]  # worker 0's four samples went to worker 1 as well
    ray.kill(actors[1], no_restart=True)
    with pytest.raises(RewardPoolError, match=r"'s0' cannot be scored: every reward worker \(2 of 2\) left the pool"):
        asyncio.run(pool.score(samples[0]))


def test_the_only_worker_lost_while_scoring_is_restarted_and_its_samples_rescored_on_it(ray_cluster):
    """The one reward worker's process is lost while it scores (as when its node leaves): Ray restarts it
    (create_reward_workers makes it restartable), the pool waits for it and re-scores its samples there: every
    row scored, with the scores an unfailed run gives, and the worker never left the pool."""
    ray = ray_cluster
    config = {"functions": {"slow": {"fn": f"{FNS}:slow_async", "kwargs": {"delay": 1.0}},
                            "bright": {"fn": f"{FNS}:mean_pixel"}}, "max_wait_ms": 20}
    (actor,) = create_reward_workers(config, 1, **_actor_options())
    ray.get(actor.ping.remote())
    pool = RewardWorkerPool([actor], restart_timeout_s=120)
    samples = _samples(4)

    async def go():
        task = asyncio.ensure_future(pool.score_many(samples))
        for _ in range(200):  # until it is scoring (bounded)
            if ray.get(actor.stats.remote())["batches"] >= 1:
                break
            await asyncio.sleep(0.02)
        ray.kill(actor, no_restart=False)  # its process dies; Ray restarts it
        return await task

    try:
        results = asyncio.run(go())
    finally:
        ray.kill(actor, no_restart=True)
    assert [r.status for r in results] == ["ok"] * 4
    assert [r.components["bright"] for r in results] == pytest.approx([i / 255 for i in range(4)])
    st = pool.stats()
    assert st["dead"] == [] and st["restarting"] == [] and st["live"] == 1 and st["rescored"] == 4
    assert pool.sent() == [8]
