"""flow_grpo's rollout loop, reimplemented for benchmarks/rollout_throughput.py (contender (b)).

A faithful reimplementation of flow_grpo's `train_sd3.py` + `pipeline_with_logprob` (Flow-GRPO-Fast window): the
K-repeat sampler's expanded prompt list cut into fixed batches, the negative prompt encoded once, each batch's prompts
encoded per image, [uncond, cond] CFG by batch, `sde_step` with per-sample sigma lookup and a noise draw every step,
one VAE decode per batch, uint8 pixels. See the docstring of rollout_throughput.py for the full description.
"""

from __future__ import annotations

import hashlib
import random
import time

import torch


# --------------------------------------------------------------------------------------------------- (b) flow_grpo
def k_repeat_batches(prompts: list[str], n: int, batch_size: int, seed: int) -> list[list[str]]:
    """flow_grpo's DistributedKRepeatSampler on one rank: every prompt repeated n times, shuffled, cut in batches."""
    expanded = [p for p in prompts for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    expanded = [expanded[i] for i in torch.randperm(len(expanded), generator=g).tolist()]
    return [expanded[i:i + batch_size] for i in range(0, len(expanded), batch_size)]


def prompt_generators(prompts: list[str], base_seed: int) -> list[torch.Generator]:
    """flow_grpo's `create_generator` (same_latent): one generator per image, seeded from sha256(prompt) + base seed,
    so the samples of a prompt share their initial noise."""
    return [torch.Generator().manual_seed((int(hashlib.sha256(p.encode()).hexdigest(), 16) + base_seed) % 2**63)
            for p in prompts]


@torch.no_grad()
def flowgrpo_rollout(pipe, prompts: list[str], args, run: int) -> dict:
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    from omniroll.sampling import sde_step

    device = pipe._execution_device
    L = args.max_sequence_length
    phases = {"encode": 0.0, "denoise": 0.0, "decode": 0.0}
    images, n_done = [], 0
    t_start = time.perf_counter()

    # train_sd3.py: the negative prompt is encoded once, before the sampling loop.
    t0 = time.perf_counter()
    neg_embeds, _, neg_pooled, _ = pipe.encode_prompt(
        prompt=[""], prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
        do_classifier_free_guidance=False, max_sequence_length=L)
    phases["encode"] += time.perf_counter() - t0
    window_rng = random.Random(args.seed * 7919 + run)

    for b, batch_prompts in enumerate(k_repeat_batches(prompts, args.n, args.batch_size, args.seed + run)):
        bs = len(batch_prompts)
        # compute_text_embeddings: the batch's prompts, one per image (duplicates encoded again), + prompt_ids.
        t0 = time.perf_counter()
        prompt_embeds, _, pooled_embeds, _ = pipe.encode_prompt(
            prompt=batch_prompts, prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=L)
        _prompt_ids = pipe.tokenizer(batch_prompts, padding="max_length", max_length=256, truncation=True,
                                     return_tensors="pt").input_ids.to(device)
        # pipeline_with_logprob: [uncond, cond] concatenation (CFG by batch)
        pe = torch.cat([neg_embeds.repeat(bs, 1, 1), prompt_embeds])
        ppe = torch.cat([neg_pooled.repeat(bs, 1), pooled_embeds])
        phases["encode"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        generator = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + run * 10_007 + b)
        # same_latent: the initial noise of each image from its prompt's generator (identical within a group)
        latent_gen = prompt_generators(batch_prompts, run) if getattr(args, "same_latent", False) else generator
        latents = pipe.prepare_latents(bs, pipe.transformer.config.in_channels, args.height, args.width,
                                       pe.dtype, device, latent_gen)
        sched = pipe.scheduler
        kwargs = {}
        if sched.config.get("use_dynamic_shifting", None):
            f = pipe.vae_scale_factor * pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift((args.height // f) * (args.width // f),
                                           sched.config.get("base_image_seq_len", 256),
                                           sched.config.get("max_image_seq_len", 4096),
                                           sched.config.get("base_shift", 0.5), sched.config.get("max_shift", 1.16))
        sched.set_timesteps(args.steps, device=device, **kwargs)
        timesteps = sched.timesteps
        # Flow-GRPO-Fast: one SDE window per call, shared by the whole batch.
        r0, r1 = args.window_range
        start = window_rng.randint(r0, r1 - args.window_size)
        window = (start, start + args.window_size)
        all_latents, all_log_probs, all_timesteps = [], [], []
        for i, t in enumerate(timesteps):
            eta = args.noise_level if window[0] <= i < window[1] else 0.0
            if i == window[0]:
                all_latents.append(latents)
            latent_model_input = torch.cat([latents] * 2)
            timestep = t.expand(latent_model_input.shape[0])
            noise_pred = pipe.transformer(hidden_states=latent_model_input, timestep=timestep,
                                          encoder_hidden_states=pe, pooled_projections=ppe,
                                          joint_attention_kwargs=None, return_dict=False)[0]
            noise_pred = noise_pred.to(pe.dtype)
            uncond, cond = noise_pred.chunk(2)
            noise_pred = uncond + args.guidance * (cond - uncond)
            # sde_step_with_logprob: fp32, sigmas looked up per batch element, noise drawn every step.
            ts = t.unsqueeze(0).expand(bs)
            step_index = [sched.index_for_timestep(tt) for tt in ts]
            sigma = sched.sigmas[step_index]
            sigma_next = sched.sigmas[[s + 1 for s in step_index]]
            noise = torch.randn(latents.shape, generator=generator, device=device, dtype=torch.float32)
            out = sde_step(latents.float(), noise_pred.float(), sigma, sigma_next, noise_level=eta, sde_type="sde",
                           noise=noise, sigma_max=sched.sigmas[1])
            latents = out.prev_sample.to(pe.dtype)
            if window[0] <= i < window[1]:
                all_latents.append(latents)
                all_log_probs.append(out.log_prob)
                all_timesteps.append(t)
        traj = {"latents": torch.stack(all_latents, dim=1), "log_probs": torch.stack(all_log_probs, dim=1),
                "timesteps": torch.stack(all_timesteps).unsqueeze(0).repeat(bs, 1)}
        assert traj["log_probs"].shape == (bs, args.window_size) and torch.isfinite(traj["log_probs"]).all()
        phases["denoise"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        z = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(z.to(pipe.vae.dtype), return_dict=False)[0]
        image = pipe.image_processor.postprocess(image, output_type="pt")
        image = (image * 255).round().clamp(0, 255).to(torch.uint8)
        phases["decode"] += time.perf_counter() - t0
        images.append(image)
        n_done += bs
    dt = time.perf_counter() - t_start
    imgs = torch.cat(images)
    assert imgs.shape == (len(prompts) * args.n, 3, args.height, args.width) and imgs.dtype == torch.uint8
    return {"seconds": dt, "images": n_done, "phases": phases}
