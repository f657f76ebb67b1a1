"""One denoising step for a batch of rows: a single batched forward (CFG rows included), then the SDE step."""

from __future__ import annotations

import contextlib

import torch

from omniroll.engine.config import EngineConfig
from omniroll.engine.invariant import BatchInvariantMode
from omniroll.engine.request import RequestState
from omniroll.models.base import DiffusionAdapter, stack_conditioning
from omniroll.sampling import sde_step


class ModelRunner:
    def __init__(self, adapter: DiffusionAdapter, config: EngineConfig):
        self.adapter = adapter
        self.config = config
        self.device = torch.device(config.device)

    def execution_mode(self):
        """The context every model call runs in (batch-invariant when configured)."""
        if self.config.batch_invariant:
            return BatchInvariantMode(self.config.invariant_block_rows)
        return contextlib.nullcontext()

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """Advance every state by one step. Each row keeps its own sigma, guidance, noise level, SDE type, window."""
        B = len(states)
        latents = torch.stack([s.latents for s in states])
        timesteps = torch.stack([s.timesteps[s.step_index] for s in states])
        cfg = [i for i, s in enumerate(states) if s.params.do_cfg]
        conds = [s.cond for s in states] + [states[i].uncond for i in cfg]
        model_latents = torch.cat([latents, latents[cfg]]) if cfg else latents
        model_t = torch.cat([timesteps, timesteps[cfg]]) if cfg else timesteps
        with self.execution_mode():
            v_all = self.adapter.velocity(
                model_latents.to(self.device), model_t.to(self.device), stack_conditioning(conds)
            ).float().cpu()
        v = v_all[:B].clone()
        for j, i in enumerate(cfg):
            uncond = v_all[B + j]
            v[i] = uncond + states[i].params.guidance_scale * (v_all[i] - uncond)

        sigma = torch.stack([s.sigmas[s.step_index] for s in states])
        sigma_next = torch.stack([s.sigmas[s.step_index + 1] for s in states])
        sigma_max = torch.stack([s.sigma_max for s in states])
        per_row = [s.draw_step_noise() for s in states]
        noise = torch.stack([n if n is not None else torch.zeros_like(s.latents) for (_, _, n), s in zip(per_row, states)])
        out = sde_step(
            latents, v, sigma, sigma_next,
            noise_level=torch.tensor([eta for eta, _, _ in per_row], dtype=torch.float32),
            sde_type=[t for _, t, _ in per_row],
            noise=noise,
            sigma_max=sigma_max,
        )
        for i, s in enumerate(states):
            s.advance(out.prev_sample[i].clone(), out.log_prob[i].clone())

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Float pixels [-1, 1] for latents [B, ...], in blocks of `decode_batch_size`; one image per call in
        batch-invariant mode (the VAE's attention block is not row-independent across batch sizes on CPU)."""
        outs = []
        block = 1 if self.config.batch_invariant else self.config.decode_batch_size
        with self.execution_mode():
            for chunk in latents.split(block):
                outs.append(self.adapter.decode(chunk.to(self.device)).float().cpu())
        return torch.cat(outs)
