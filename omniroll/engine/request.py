"""Per-request state inside the engine: its generator, its latent, its step, what it has recorded."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from omniroll.engine.params import GenerationRequest
from omniroll.models.base import Conditioning
from omniroll.sampling import draw_sde_window, make_generator

#: callback(output, exception): exactly one of the two is set.
DoneCallback = Callable[[Optional[object], Optional[BaseException]], None]


class RequestState:
    """One sample in flight. Everything random comes from its own generator, in a fixed order: initial latent,
    window start, then one noise draw per SDE step, so the sample never depends on its batch mates. With
    `latent_seed` the initial latent and the window start come from a generator of that seed instead (shared by a
    group), the window's noise still from the request's own."""

    def __init__(self, request: GenerationRequest, sigmas: torch.Tensor, latent_shape: tuple[int, ...],
                 on_done: DoneCallback, num_train_timesteps: int = 1000):
        self.request = request
        self.params = request.sampling_params
        self.on_done = on_done
        self.submitted_at = time.time()
        self.sigmas = sigmas  # [T + 1] fp32, ends at 0
        self.timesteps = sigmas[:-1] * num_train_timesteps  # what the denoiser sees (as diffusers computes them)
        self.generator = make_generator(request.seed)
        p = self.params
        prefix_gen = self.generator if p.latent_seed is None else make_generator(p.latent_seed)
        self.latents = torch.randn(latent_shape, generator=prefix_gen, dtype=torch.float32)
        self.window = draw_sde_window(p.num_inference_steps, p.sde_window_size, p.sde_window_range, prefix_gen)
        self.step_index = 0
        self.num_preempted = 0
        self.cond: Optional[Conditioning] = None
        self.uncond: Optional[Conditioning] = None
        self.weight_version: Optional[int] = None  # the engine's weight version, set when the request is admitted
        # Recorded over the SDE window.
        self.rec_latents: list[torch.Tensor] = []
        self.rec_log_probs: list[torch.Tensor] = []
        self.rec_steps: list[int] = []

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_rows(self) -> int:
        return 2 if self.params.do_cfg else 1

    @property
    def done(self) -> bool:
        return self.step_index >= self.params.num_inference_steps

    @property
    def in_window(self) -> bool:
        return self.window[0] <= self.step_index < self.window[1]

    @property
    def sigma_max(self) -> torch.Tensor:
        """The schedule's second sigma: what the `sde` step uses in place of sigma == 1."""
        return self.sigmas[min(1, len(self.sigmas) - 1)]

    @property
    def batch_key(self) -> tuple:
        return self.params.batch_key()

    def draw_step_noise(self) -> tuple[float, str, Optional[torch.Tensor]]:
        """Draw this step's noise from the request's generator (advancing it) and return (noise_level, sde_type,
        noise). Outside the SDE window (or for an ODE request) nothing is drawn: (0.0, "ode", None). Call exactly
        once per step, in step order: the draws are what make the sample reproducible."""
        if not (self.in_window and self.params.stochastic):
            return 0.0, "ode", None
        noise = torch.randn(self.latents.shape, generator=self.generator, dtype=torch.float32)
        return self.params.noise_level, self.params.sde_type, noise

    def advance(self, new_latents: torch.Tensor, log_prob: torch.Tensor) -> None:
        """Apply one step's result; record it when the step is in the window."""
        if self.in_window:
            if not self.rec_latents:
                self.rec_latents.append(self.latents)
            self.rec_latents.append(new_latents)
            self.rec_log_probs.append(log_prob)
            self.rec_steps.append(self.step_index)
        self.latents = new_latents
        self.step_index += 1
