"""Engine behaviour on the tiny SD3: parity with diffusers, batch invariance, per-row parameters, windows,
recompute, validation, abort, prompt cache."""

import asyncio

import pytest
import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.output_assembly import quantize_pixels
from omniroll.sampling import make_generator, sde_step

BASE = dict(height=64, width=64, num_inference_steps=4, max_sequence_length=16)


def req(rid, prompt="a photo of a cat", seed=0, negative=None, **params):
    return GenerationRequest(request_id=rid, prompt=prompt, negative_prompt=negative, seed=seed,
                             sampling_params=SamplingParams(**{**BASE, **params}))


def same(a, b):
    assert a.stop_reason == b.stop_reason == "completed"
    assert torch.equal(a.diffusion_output, b.diffusion_output)
    assert torch.equal(a.extra_fields["all_latents"], b.extra_fields["all_latents"])
    if a.log_probs is not None or b.log_probs is not None:
        assert torch.equal(a.log_probs, b.log_probs)


def test_ode_matches_diffusers_pipeline(tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, batch_invariant=False)
    r = req("parity", prompt="a red car", seed=7, noise_level=0.0, guidance_scale=4.5, output_type="both")
    out = engine.generate([r])[0]
    engine.shutdown()
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    init = torch.randn(engine.adapter.latent_shape(64, 64), generator=make_generator(7))[None]
    ref = pipe(prompt="a red car", num_inference_steps=4, guidance_scale=4.5, height=64, width=64,
               max_sequence_length=16, latents=init.clone(), output_type="latent").images
    assert torch.allclose(out.extra_fields["latents"], ref[0], atol=1e-5, rtol=1e-5)
    ref_pixels = pipe.vae.decode(ref / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor).sample
    assert (out.diffusion_output.int() - quantize_pixels(ref_pixels[0]).int()).abs().max() <= 1


def test_output_contract(engine):
    out = engine.generate([req("contract", sde_window_size=2, sde_window_range=(0, 4))])[0]
    assert out.stop_reason == "completed" and out.num_preempted == 0
    assert out.diffusion_output.dtype == torch.uint8 and out.diffusion_output.shape == (3, 64, 64)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == (2,)
    ef = out.extra_fields
    start, end = ef["sde_window"]
    assert end - start == 2 and 0 <= start <= 2
    assert ef["all_latents"].shape == (3, 16, 8, 8) and ef["all_latents"].dtype == torch.float32
    sig = engine.adapter.sigmas(4, 64, 64)
    assert torch.equal(ef["sigmas"], sig[start:end]) and torch.equal(ef["sigmas_next"], sig[start + 1:end + 1])
    assert torch.equal(ef["all_timesteps"], sig[start:end] * 1000)
    assert ef["noise_level"] == 0.7 and ef["sde_type"] == "sde" and ef["weight_version"] == 0
    assert ef["prompt_embeds"].ndim == 2 and ef["negative_prompt_embeds"].shape == ef["prompt_embeds"].shape
    default = engine.generate([req("default-window")])[0]
    assert default.extra_fields["sde_window"] == (0, 3) and default.log_probs.shape == (3,)


def test_batch_invariance_alone_vs_any_batch(engine):
    target = req("t", prompt="a blue bird", seed=11)
    alone = engine.generate([target])[0]
    mates = [req(f"m{i}", prompt=f"a dog {i}", seed=100 + i, guidance_scale=1.0 + i % 2 * 3.5) for i in range(7)]
    for batch in ([target] + mates[:1], mates[:3] + [target], mates + [target], [mates[5], target, mates[2]]):
        outs = engine.generate(batch)
        same(alone, next(o for o in outs if o.request_id == "t"))


def test_every_row_keeps_its_own_parameters(engine):
    variants = [
        req("a", seed=1, noise_level=0.0),
        req("b", seed=2, sde_type="cps", noise_level=0.8),
        req("c", seed=3, num_inference_steps=6, sde_window_size=1, sde_window_range=(2, 5)),
        req("d", seed=4, guidance_scale=1.0),
        req("e", seed=5, noise_level=1.2, logprobs=False),
    ]
    alone = {r.request_id: engine.generate([r])[0] for r in variants}
    packed = engine.generate(variants)
    for r, out in zip(variants, packed):
        same(alone[r.request_id], out)
        p = r.sampling_params
        assert out.extra_fields["noise_level"] == (p.noise_level if p.stochastic else 0.0)
        assert out.extra_fields["sde_type"] == (p.sde_type if p.stochastic else "ode")
    assert packed[4].log_probs is None and "negative_prompt_embeds" not in packed[3].extra_fields
    assert packed[2].extra_fields["all_latents"].shape[0] == 2
    assert packed[4].extra_fields["all_latents"].shape[0] == 0  # no log-probs: no trajectory kept


def test_recompute_reproduces_rollout_log_probs_exactly(engine):
    out = engine.generate([req("rc", seed=21, sde_type="sde", sde_window_size=2, sde_window_range=(0, 3))])[0]
    ef = out.extra_fields
    cond = {k: ef[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    unc = {k: ef[f"negative_{k}"] for k in cond}
    stacked = {k: torch.stack([cond[k], unc[k]]) for k in cond}
    for k in range(len(ef["sigmas"])):
        x = ef["all_latents"][k]
        t = ef["all_timesteps"][k]
        with engine.runner.execution_mode():
            v2 = engine.adapter.velocity(torch.stack([x, x]), torch.stack([t, t]), stacked).float()
        v = v2[1] + ef["guidance_scale"] * (v2[0] - v2[1])
        rec = sde_step(x[None], v[None], ef["sigmas"][k], ef["sigmas_next"][k], ef["noise_level"], ef["sde_type"],
                       prev_sample=ef["all_latents"][k + 1][None], sigma_max=ef["sigma_max"])
        assert torch.equal(rec.log_prob[0], out.log_probs[k])


@pytest.mark.parametrize("field,value,match", [
    ("height", 8, "height"), ("height", 72, "height"), ("width", 5000, "width"),
    ("num_inference_steps", 0, "num_inference_steps"), ("guidance_scale", -1.0, "guidance_scale"),
    ("noise_level", -0.1, "noise_level"), ("sde_type", "euler", "sde_type"),
    ("sde_window_size", 9, "sde_window_size"), ("sde_window_range", (3, 2), "sde_window_range"),
    ("sde_window_range", (0, 9), "sde_window_range"), ("output_type", "png", "output_type"),
    ("max_sequence_length", 0, "max_sequence_length"), ("bogus", 1, "bogus"),
])
def test_invalid_fields_name_the_field(engine, field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        engine.generate([req("bad", **{field: value})])


def test_bad_request_does_not_disturb_running_ones(engine):
    good = [req(f"g{i}", seed=30 + i) for i in range(3)]
    alone = [engine.generate([g])[0] for g in good]

    async def run():
        tasks = [asyncio.create_task(engine.generate_async(g)) for g in good]
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="height"):
            await engine.generate_async(req("bad", height=72))
        with pytest.raises(ValueError):
            GenerationRequest(request_id="x", prompt="p", seed=-1)
        return await asyncio.gather(*tasks)

    for a, b in zip(alone, asyncio.run(run())):
        same(a, b)


def test_abort_is_acknowledged_and_spares_others(engine):
    long = req("long", num_inference_steps=40, seed=3)
    other = req("other", seed=4)
    alone = engine.generate([other])[0]

    async def run():
        t_long = asyncio.create_task(engine.generate_async(long))
        t_other = asyncio.create_task(engine.generate_async(other))
        while engine.stats()["running"] < 1:
            await asyncio.sleep(0.005)
        assert await asyncio.to_thread(engine.abort, "long") is True
        return await t_long, await t_other

    aborted, done = asyncio.run(run())
    assert aborted.stop_reason == "aborted" and aborted.diffusion_output.numel() == 0
    same(alone, done)
    assert engine.abort("never-existed") is False


def test_prompt_encoded_once_per_group(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path)
    engine.generate([req(f"s{i}", prompt="one prompt", seed=i) for i in range(6)])
    cache = engine.stats()["prompt_cache"]
    engine.shutdown()
    assert cache["misses"] == 2  # the prompt and the empty negative prompt, once each
    assert cache["hits"] == 10


def test_scheduler_respects_max_batch_rows(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    outs = engine.generate([req(f"r{i}", seed=i) for i in range(5)])  # CFG: 2 rows each -> 2 at a time
    stats = engine.stats()
    engine.shutdown()
    assert all(o.stop_reason == "completed" for o in outs)
    assert stats["mean_rows_per_step"] <= 4


def test_nan_pixels_raise():
    with pytest.raises(FloatingPointError):
        quantize_pixels(torch.tensor([0.0, float("nan")]))
    assert quantize_pixels(torch.tensor([-3.0, -1.0, -0.5, 0.0, 1.0, 2.0])).tolist() == [0, 0, 64, 128, 255, 255]


def test_abort_all_stops_running_and_waiting_requests(tiny_sd3_path):
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)  # 2 CFG requests run, 2 wait

    async def run():
        tasks = [asyncio.create_task(engine.generate_async(req(f"aa{i}", seed=i, num_inference_steps=40)))
                 for i in range(4)]
        while engine.stats()["running"] < 2:
            await asyncio.sleep(0.005)
        ids = await asyncio.to_thread(engine.abort_all)
        return ids, await asyncio.gather(*tasks)

    ids, outs = asyncio.run(run())
    assert sorted(ids) == [f"aa{i}" for i in range(4)]
    assert all(o.stop_reason == "aborted" for o in outs)
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    assert engine.generate([req("after", seed=1)])[0].stop_reason == "completed"
    engine.shutdown()
