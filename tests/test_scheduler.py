"""Fair scheduling across batch keys: no running request sits out more than one step per other active key, and a
request of another key is never held in the waiting queue behind a full key."""

import asyncio
import random

import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.request import RequestState
from omniroll.engine.scheduler import Scheduler


def state(rid, steps=4, height=64, guidance=4.5, seq=16, seed=0):
    params = SamplingParams(height=height, width=64, num_inference_steps=steps, guidance_scale=guidance,
                            max_sequence_length=seq)
    req = GenerationRequest(request_id=rid, prompt="p", seed=seed, sampling_params=params)
    return RequestState(req, torch.linspace(1, 0, steps + 1), (1, 2, 2), on_done=lambda o, e: None)


def test_wait_is_bounded_by_other_active_keys():
    """Random arrivals of five keys (text lengths), steps from 1 to 60: while a running request waits, no key is
    served twice (one step per other active key at most); nothing starves."""
    rng = random.Random(0)
    sched = Scheduler(max_batch_size=8)
    served_while_waiting, worst, done, n = {}, 0, 0, 0
    for tick in range(3000):
        if n < 200 and rng.random() < 0.3:
            sched.add(state(f"r{n}", steps=rng.randint(1, 60), seq=8 * rng.randint(1, 5),
                            guidance=rng.choice([1.0, 4.5])))
            n += 1
        sched.admit()
        batch = sched.schedule()
        if not batch:
            continue
        key = batch[0].batch_key
        assert sum(s.num_rows for s in batch) <= 8 and all(s.batch_key == key for s in batch)
        for s in sched.running:
            if s in batch:
                served_while_waiting[id(s)] = []
            else:
                seen = served_while_waiting.setdefault(id(s), [])
                assert key != s.batch_key and key not in seen, (s.request_id, seen, key)
                seen.append(key)
                worst = max(worst, len(seen))
        for s in batch:
            s.step_index += 1
        finished = [s for s in batch if s.done]
        sched.finish(finished)
        done += len(finished)
    assert done == n == 200 and not sched.has_work()
    assert worst >= 2  # several keys really competed


def test_full_key_does_not_block_another_key_in_the_queue():
    sched = Scheduler(max_batch_size=4)
    for i in range(3):
        sched.add(state(f"a{i}", steps=1000))  # CFG: two rows each, two fit
    sched.add(state("b", steps=2, height=32))
    admitted = [s.request_id for s in sched.admit()]
    assert admitted == ["a0", "a1", "b"] and [s.request_id for s in sched.waiting] == ["a2"]
    # FCFS within a key: a later one-row request of key a does not overtake a2
    sched.add(state("a3", steps=1, guidance=1.0))
    sched.finish([sched.running[0]])
    assert [s.request_id for s in sched.admit()] == ["a2"]


def test_short_request_of_another_shape_is_not_held_behind_a_long_one(tiny_sd3_path):
    """Head-of-line blocking, on the engine: a 2-step request of another shape arrives while a long request runs; it
    sits out at most one step per step it runs and finishes long before the long one."""
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    base = dict(width=32, max_sequence_length=16, guidance_scale=4.5)
    long = GenerationRequest(request_id="long", prompt="a cat", seed=1,
                             sampling_params=SamplingParams(height=32, num_inference_steps=60, **base))
    short = GenerationRequest(request_id="short", prompt="a dog", seed=2,
                              sampling_params=SamplingParams(height=64, num_inference_steps=2, **base))

    async def run():
        t_long = asyncio.create_task(engine.generate_async(long))
        while engine.stats()["steps"] < 1:
            await asyncio.sleep(0.002)
        out_short = await engine.generate_async(short)
        steps_when_short_done = engine.stats()["steps"]
        return out_short, steps_when_short_done, await t_long

    try:
        out_short, steps_at_short, out_long = asyncio.run(run())
        alone = engine.generate([short.model_copy(update={"request_id": "short-alone"})])[0]
    finally:
        engine.shutdown()
    assert out_short.stop_reason == out_long.stop_reason == "completed"
    assert out_short.num_preempted <= 2
    assert steps_at_short < 60  # the long request was still running
    assert torch.equal(out_short.diffusion_output, alone.diffusion_output)
