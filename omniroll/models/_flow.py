"""Sigma schedules exactly as diffusers' flow-matching pipelines set them (shared by the adapters)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


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
