"""Group prefix sharing (`latent_seed`, flow_grpo's same_latent): the common ODE prefix of a group runs once and
forks at the window's start; every output stays bitwise identical to running the sample alone."""

import asyncio

import pytest
import torch

from omniroll import GenerationRequest, SamplingParams

BASE = dict(height=32, width=32, max_sequence_length=16, guidance_scale=4.5, noise_level=0.8)


def member(i, steps=6, window=(1, (3, 5)), latent_seed=77, prompt="a green frog", **kw):
    size, rng = window
    return GenerationRequest(request_id=f"m{i}", prompt=prompt, seed=1000 + i, sampling_params=SamplingParams(
        **{**BASE, "num_inference_steps": steps, "sde_window_size": size, "sde_window_range": rng,
           "latent_seed": latent_seed, **kw}))


def same(a, b):
    assert a.stop_reason == b.stop_reason == "completed"
    assert torch.equal(a.diffusion_output, b.diffusion_output)
    assert torch.equal(a.extra_fields["all_latents"], b.extra_fields["all_latents"])
    assert torch.equal(a.log_probs, b.log_probs)
    assert a.extra_fields["sde_window"] == b.extra_fields["sde_window"]


def test_group_shares_its_prefix_and_every_output_is_bitwise_alone(engine, alone):
    group = [member(i) for i in range(4)] + [member(9, latent_seed=78)]  # + one of another group
    saved0 = engine.stats()["prefix_steps_saved"]
    outs = engine.generate(group)
    start = outs[0].extra_fields["sde_window"][0]
    assert start >= 3 and all(o.extra_fields["sde_window"][0] == start for o in outs[:4])
    assert engine.stats()["prefix_steps_saved"] - saved0 == 3 * start  # three followers skipped the prefix
    for r, o in zip(group, outs):
        same(alone(r), o)
    # same initial prefix, own window noise: the group's window latents start equal and then differ
    first = [o.extra_fields["all_latents"] for o in outs[:4]]
    assert all(torch.equal(first[0][0], x[0]) for x in first[1:])
    assert not torch.equal(first[0][1], first[1][1])
    # another latent_seed is another group: another initial noise
    assert not torch.equal(outs[4].extra_fields["all_latents"][0], first[0][0])


def test_members_differing_outside_the_prefix_still_share(engine, alone):
    group = [member(0), member(1, noise_level=0.3, sde_type="cps"), member(2, logprobs=False, output_type="both")]
    saved0 = engine.stats()["prefix_steps_saved"]
    outs = engine.generate(group)
    assert engine.stats()["prefix_steps_saved"] - saved0 == 2 * outs[0].extra_fields["sde_window"][0]
    same(alone(group[0]), outs[0])
    same(alone(group[1]), outs[1])
    assert torch.equal(alone(group[2]).diffusion_output, outs[2].diffusion_output)


def test_late_members_and_an_aborted_leader(engine, alone):
    """Members admitted while the leader is inside its prefix, and after it forked; then the leader is aborted inside
    its prefix and a follower leads on. Every completed output equals the sample run alone."""
    long = dict(steps=30, window=(2, (20, 30)))
    lead, late, after = member(0, **long), member(1, **long), member(2, **long)

    async def wait_step(k):
        while True:
            states = [s for s in engine.scheduler.running if s.request_id == "m0"]
            if states and states[0].step_index >= k:
                return
            await asyncio.sleep(0.001)

    async def late_join():
        t0 = asyncio.create_task(engine.generate_async(lead))
        await wait_step(3)
        t1 = asyncio.create_task(engine.generate_async(late))  # joins the leader inside the prefix
        await wait_step(24)
        t2 = asyncio.create_task(engine.generate_async(after))  # forks at once from the recorded fork latent
        return await asyncio.gather(t0, t1, t2)

    saved0 = engine.stats()["prefix_steps_saved"]
    outs = asyncio.run(late_join())
    start = outs[0].extra_fields["sde_window"][0]
    assert engine.stats()["prefix_steps_saved"] - saved0 == 2 * start
    for r, o in zip((lead, late, after), outs):
        same(alone(r), o)

    async def abort_leader():
        tasks = [asyncio.create_task(engine.generate_async(member(i, **long))) for i in range(3)]
        await wait_step(5)
        assert await asyncio.to_thread(engine.abort, "m0") is True
        return await asyncio.gather(*tasks)

    saved0 = engine.stats()["prefix_steps_saved"]
    outs = asyncio.run(abort_leader())
    assert outs[0].stop_reason == "aborted"
    # the heir took over the leader's >= 5 steps, the other follower forked at the window start
    assert engine.stats()["prefix_steps_saved"] - saved0 >= 5 + outs[1].extra_fields["sde_window"][0]
    for i, o in enumerate(outs[1:], start=1):
        same(alone(member(i, **long)), o)


def test_latent_seed_is_validated():
    with pytest.raises(ValueError, match="latent_seed"):
        SamplingParams(latent_seed=-1)
