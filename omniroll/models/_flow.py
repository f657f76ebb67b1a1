"""Sigma schedules exactly as diffusers' flow-matching pipelines set them (shared by the adapters)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from omniroll.models.base import DiffusionAdapter, check_int


def pipeline_sigmas(scheduler_config: dict, num_steps: int, image_seq_len: Optional[int] = None,
                    linspace: bool = False, default_max_shift: float = 1.15) -> torch.Tensor:
    """[T + 1] fp32 sigmas of a `FlowMatchEulerDiscreteScheduler` built from `scheduler_config`, set the way the
    family's pipeline sets it: the resolution-dependent `mu` (diffusers' `calculate_shift`) when the scheduler
    shifts dynamically, and `linspace`: the custom sigmas linspace(1, 1/T, T) that FLUX and Qwen-Image pass."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    cfg = scheduler.config
    kwargs = {}
    if cfg.get("use_dynamic_shifting", False):
        kwargs["mu"] = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256),
                                       cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                       cfg.get("max_shift", default_max_shift))
    if linspace:
        kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
    retrieve_timesteps(scheduler, num_steps if not linspace else None, "cpu", **kwargs)
    sig = scheduler.sigmas.detach().to(torch.float32).cpu()
    if sig.shape != (num_steps + 1,):
        raise ValueError(f"scheduler returned {tuple(sig.shape)} sigmas for {num_steps} steps")
    return sig


class PackedLatentAdapter(DiffusionAdapter):
    """Shapes and schedule of the 2x2-packed image families (FLUX.1, Qwen-Image): the latent is
    [in_channels / 4, H / f, W / f] before packing, and the pipeline's sigmas are linspace(1, 1/T, T) shifted by
    mu(image_seq_len) (dynamic shift), cached per (steps, h, w) in `_sigma_cache` (`DiffusionAdapter._adopt` makes
    it)."""

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        self.check_num_frames(num_frames)
        self.limits.check(height, width)
        f = self.vae_scale_factor
        return (self.transformer.config.in_channels // 4, height // f, width // f)

    def sigmas(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        check_int("num_inference_steps", num_inference_steps, 1)
        _, h, w = self.latent_shape(height, width, num_frames)
        key = (num_inference_steps, h, w)
        if key not in self._sigma_cache:
            self._sigma_cache[key] = pipeline_sigmas(self.scheduler_config, num_inference_steps,
                                                     image_seq_len=(h // 2) * (w // 2), linspace=True)
        return self._sigma_cache[key].clone()
