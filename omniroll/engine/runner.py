"""The engine's model calls: one denoising step for a batch of rows (`ModelRunner.step`: a single batched forward,
CFG rows included, then the SDE step) and the decode of finished samples, each inside the execution mode of
engine/execution.py (batch-invariant kernels), which the trainer's recompute enters too.

Everything stays on the engine's device: the rows' latents, timesteps, sigmas, noise levels and noise are device
tensors held by their RequestStates, the CFG mix and the SDE step run where the velocity is, and nothing is read
back to the host, so a step queues its kernels without waiting for the previous step to finish.
"""

from __future__ import annotations

import torch

from omniroll.engine.config import EngineConfig
from omniroll.engine.execution import execution_mode
from omniroll.engine.request import RequestState
from omniroll.models.base import NO_CFG, DiffusionAdapter, stack_conditioning
from omniroll.sampling import sde_step


class ModelRunner:
    def __init__(self, adapter: DiffusionAdapter, config: EngineConfig):
        self.adapter = adapter
        self.config = config
        self.device = torch.device(config.device)

    def execution_mode(self):
        """The context every model call runs in (batch-invariant when configured)."""
        return execution_mode(self.execution_info())

    def execution_info(self) -> dict:
        """How this engine's model calls run; recorded in every trajectory (`extra_fields["execution"]`), so a
        trainer's recompute enters the same mode with the same block size and dtype without copying them by hand."""
        return {"batch_invariant": bool(self.config.batch_invariant),
                "invariant_block_rows": int(self.config.invariant_block_rows),
                "dtype": str(self.config.dtype).removeprefix("torch.")}

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """Advance every state by one step. Each row keeps its own sigma, guidance, noise level, SDE type, window.
        All rows share a batch key, hence a latent shape and a denoiser (`expert`)."""
        inputs = [s.step_inputs() for s in states]  # (timestep, sigma, sigma_next, noise_level, sde_code)
        cfg = [s for s in states if s.cfg_scale != NO_CFG]
        latents = torch.stack([s.latents for s in states])
        guidance = None
        if self.adapter.guidance_kind == "distilled":
            guidance = torch.stack([s.dev_guidance for s in states])
        with self.execution_mode():
            v = self.adapter.guided_velocity(
                latents, torch.stack([x[0] for x in inputs]), stack_conditioning([s.cond for s in states]),
                stack_conditioning([s.uncond for s in cfg]) if cfg else None, [s.cfg_scale for s in states],
                guidance=guidance, expert=states[0].expert,
            )

        out = sde_step(
            latents, v,
            torch.stack([x[1] for x in inputs]), torch.stack([x[2] for x in inputs]),
            noise_level=torch.stack([x[3] for x in inputs]),
            sde_type=torch.stack([x[4] for x in inputs]),
            noise=torch.stack([s.draw_step_noise() for s in states]),
            sigma_max=torch.stack([s.dev_sigma_max for s in states]),
        )
        for i, s in enumerate(states):
            s.advance(out.prev_sample[i].clone(), out.log_prob[i].clone())

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Float pixels [-1, 1] on the host for latents [B, ...] ([B, 3, H, W] or [B, T, 3, H, W]), in blocks of
        `decode_batch_size` samples; the only device-to-host copy of a request's pixels. In batch-invariant mode every
        block has exactly that many samples (zero latents pad the last one): at one fixed batch shape the VAE's
        kernels give a sample the same bits whatever its position and block mates (tested), while another batch size
        may move them (~1e-5), so a sample's pixels never depend on what finished with it."""
        block = self.config.decode_batch_size
        outs = []
        for chunk in latents.split(block):
            n = chunk.shape[0]
            if self.config.batch_invariant and n < block:
                chunk = torch.cat([chunk, chunk.new_zeros((block - n,) + tuple(chunk.shape[1:]))])
            outs.append(self.adapter.decode(chunk.to(self.device)).float().cpu()[:n])
        return torch.cat(outs)
