"""Deterministic solvers (sampling/solvers.py) through the engine on the tiny SD3: DPM-Solver++(2M) against diffusers'
DPMSolverMultistepScheduler, the default Euler path against FlowMatchEulerDiscreteScheduler, batch invariance, the
solver history across a prefix-sharing fork, and the `solver` key's validation."""

import asyncio

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

from omniroll import GenerationRequest, SamplingParams
from omniroll.config import ConfigError, load_config
from omniroll.engine.engine import DiffusionEngine
from omniroll.models.base import NO_CFG, stack_conditioning
from omniroll.sampling import make_generator
from omniroll.sampling.solvers import dpmpp_2m_plan

BASE = dict(height=64, width=64, max_sequence_length=16, output_type="latent")


def req(rid, prompt="a red car", seed=7, **params):
    return GenerationRequest(request_id=rid, prompt=prompt, seed=seed,
                             sampling_params=SamplingParams(**{**BASE, "num_inference_steps": 6, **params}))


def reference_loop(engine, scheduler, prompt, seed, steps, guidance):
    """The same model's velocity (the engine's own call, in its execution mode) driven by a diffusers scheduler's
    `step`, from the same initial noise, on omniroll's sigmas and timesteps."""
    ad = engine.adapter
    sigmas = ad.sigmas(steps, 64, 64)
    timesteps = sigmas[:-1] * 1000
    x = torch.randn(ad.latent_shape(64, 64), generator=make_generator(seed))[None]
    cond = stack_conditioning(ad.encode_prompts([prompt], 16))
    scale = ad.cfg_scale(guidance)
    uncond = stack_conditioning(ad.encode_prompts([""], 16)) if scale != NO_CFG else None
    with torch.no_grad(), engine.runner.execution_mode():
        for k in range(steps):
            v = ad.guided_velocity(x, timesteps[k:k + 1], cond, uncond, [scale])
            x = scheduler.step(v, timesteps[k], x).prev_sample
    return x[0]


def dpm_solver_scheduler(sigmas: torch.Tensor) -> DPMSolverMultistepScheduler:
    """diffusers' DPM-Solver++(2M) for flow matching. Its `set_timesteps` (diffusers 0.42) takes no sigmas and draws
    its flow sigmas from 1 - 1/1000 down, so it is given omniroll's schedule through `sigmas`, what its `step` reads."""
    sched = DPMSolverMultistepScheduler(num_train_timesteps=1000, algorithm_type="dpmsolver++", solver_order=2,
                                        solver_type="midpoint", prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=3.0, final_sigmas_type="zero",
                                        lower_order_final=True)
    sched.set_timesteps(len(sigmas) - 1)
    sched.sigmas = sigmas.clone()
    sched.set_begin_index(0)
    return sched


@pytest.mark.parametrize("guidance,steps", [(4.5, 6), (1.0, 10), (4.5, 2)])
def test_dpmpp_2m_matches_diffusers_dpm_solver_multistep(engine, guidance, steps):
    out = engine.generate([req("dpm", solver="dpmpp_2m", noise_level=0.0, guidance_scale=guidance,
                               num_inference_steps=steps)])[0].diffusion_output
    ref = reference_loop(engine, dpm_solver_scheduler(engine.adapter.sigmas(steps, 64, 64)), "a red car", 7, steps,
                         guidance)
    assert (out - ref).abs().max().item() <= 1e-6  # measured: 0.0 (the same fp32 operations in the same order)
    euler = engine.generate([req("euler", noise_level=0.0, guidance_scale=guidance,
                                 num_inference_steps=steps)])[0].diffusion_output
    if steps > 2:  # with two steps the second-order term vanishes (the first step starts at sigma 1)
        assert (out - euler).abs().max().item() > 1e-3


def test_euler_default_is_diffusers_flow_match_euler_bitwise(engine, tiny_sd3_path):
    default = engine.generate([req("default", noise_level=0.0)])[0].diffusion_output
    named = engine.generate([req("named", noise_level=0.0, solver="euler")])[0].diffusion_output
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_sd3_path, subfolder="scheduler")
    sched.set_timesteps(6)
    sched.set_begin_index(0)
    assert torch.equal(sched.sigmas.float(), engine.adapter.sigmas(6, 64, 64))  # the checkpoint's own schedule
    ref = reference_loop(engine, sched, "a red car", 7, 6, 4.5)
    assert torch.equal(default, named) and torch.equal(default, ref)


def test_dpmpp_2m_row_is_bitwise_the_same_in_any_batch(engine):
    target = req("t", prompt="a blue bird", seed=11, solver="dpmpp_2m", noise_level=0.0)
    alone = engine.generate([target])[0].diffusion_output
    mates = [req("m0", seed=100), req("m1", seed=101, solver="dpmpp_2m", guidance_scale=1.0, noise_level=0.0),
             req("m2", seed=102, solver="dpmpp_2m", sde_window_size=2, sde_window_range=(1, 5)),
             req("m3", seed=103, solver="dpmpp_2m", noise_level=0.0, num_inference_steps=9),
             req("m4", seed=104, noise_level=0.0)]
    for batch in ([target] + mates[:1], mates[:3] + [target], mates + [target], [mates[3], target, mates[2]]):
        outs = engine.generate(batch)
        assert torch.equal(alone, next(o for o in outs if o.request_id == "t").diffusion_output)


def test_sde_window_steps_stay_sde_steps_and_recompute_exactly(engine):
    """With dpmpp_2m the window's steps are still `sde_step`'s: the trainer's recompute returns their log-probs
    bitwise; the solver's history restarts after the window (its plan)."""
    from omniroll.train import TrajectoryBatch, recompute_log_probs

    r = req("w", solver="dpmpp_2m", sde_window_size=2, sde_window_range=(1, 5), output_type="pixel")
    out = engine.generate([r])[0]
    start, end = out.extra_fields["sde_window"]
    traj = TrajectoryBatch.from_outputs([out])
    for k in range(end - start):
        rec = recompute_log_probs(engine.adapter, traj, k)
        assert torch.equal(rec.log_prob[0], out.log_probs[k])
    deterministic = [not (start <= k < end) for k in range(6)]
    plan = dpmpp_2m_plan(engine.adapter.sigmas(6, 64, 64), deterministic)
    after = end  # the first step after the window is first order; the last step too
    assert plan.uses_history[after] is False and plan.uses_history[5] is False
    assert plan.uses_history[start] is False  # a window step: not the solver's
    assert all(plan.uses_history[k] for k in range(1, start))


def test_dpmpp_2m_plan_orders():
    sigmas = torch.linspace(1.0, 0.0, 7)
    assert dpmpp_2m_plan(sigmas, [True] * 6).uses_history == (False, True, True, True, True, False)
    assert dpmpp_2m_plan(sigmas, [True, True, False, True, True, True]).uses_history == (
        False, True, False, False, True, False)
    with pytest.raises(ValueError, match="sigmas must be fp32 of shape"):
        dpmpp_2m_plan(sigmas[:-1], [True] * 6)


PREFIX = dict(height=32, width=32, max_sequence_length=16, guidance_scale=4.5, noise_level=0.8, solver="dpmpp_2m")


def member(i, steps=8, window=(1, (4, 7)), **kw):
    size, rng = window
    return GenerationRequest(request_id=f"p{i}", prompt="a green frog", seed=1000 + i, sampling_params=SamplingParams(
        **{**PREFIX, "num_inference_steps": steps, "sde_window_size": size, "sde_window_range": rng,
           "latent_seed": 77, **kw}))


def test_prefix_sharing_copies_the_solver_history(tiny_sd3_path):
    """A follower forks at the window start (or takes over from an aborted leader) with the leader's latent and its
    solver history: an ODE follower's next dpmpp_2m step is second order and reads it. Every output equals the
    sample run alone."""
    shared = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    lone = DiffusionEngine.from_pretrained(tiny_sd3_path, prefix_sharing=False)
    try:
        group = [member(0), member(1, noise_level=0.0), member(2, sde_type="cps", noise_level=0.5)]
        outs = shared.generate(group)
        start = outs[0].extra_fields["sde_window"][0]
        assert start >= 4 and shared.stats()["prefix_steps_saved"] == 2 * start
        for r, o in zip(group, outs):
            assert torch.equal(lone.generate([r])[0].diffusion_output, o.diffusion_output)

        long = dict(steps=30, window=(2, (20, 30)))

        async def abort_leader():
            tasks = [asyncio.create_task(shared.generate_async(member(10 + i, **long))) for i in range(2)]
            while not any(s.request_id == "p10" and s.step_index >= 5 for s in shared.scheduler.running):
                await asyncio.sleep(0.001)
            assert await asyncio.to_thread(shared.abort, "p10") is True
            return await asyncio.gather(*tasks)

        saved = shared.stats()["prefix_steps_saved"]
        aborted, heir = asyncio.run(abort_leader())
        assert aborted.stop_reason == "aborted" and shared.stats()["prefix_steps_saved"] - saved >= 5
        assert torch.equal(lone.generate([member(11, **long)])[0].diffusion_output, heir.diffusion_output)
    finally:
        shared.shutdown()
        lone.shutdown()


def test_a_lost_history_is_refused(engine):
    """A second-order step with no history (a fork that did not copy it) is refused, naming the step."""
    from omniroll.engine.admission import build_state

    s = build_state(engine.adapter, engine.config, "cpu", req("lost", solver="dpmpp_2m", noise_level=0.0), None)
    s.start()
    s.step_index = 2
    with pytest.raises(RuntimeError, match="step 2 of solver 'dpmpp_2m' needs the previous step's history"):
        s.solver_inputs()


def test_bad_solver_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"pipeline\.solver: Input should be 'euler' or 'dpmpp_2m'"):
        load_config(None, ["pipeline.solver=dpm"])
    with pytest.raises(ValueError, match="solver"):
        SamplingParams(solver="heun")
    cfg = load_config(None, ["pipeline.solver=dpmpp_2m"])
    assert cfg.sampling_params()["solver"] == cfg.sampling_params(validate=True)["solver"] == "dpmpp_2m"
