"""Sigma schedules for rectified-flow models (fp32)."""

from __future__ import annotations


import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_match_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """[T + 1] sigmas from 1 to 0 (the last entry 0), as FlowMatchEulerDiscreteScheduler builds them (static shift).

    Adapters use the checkpoint's own scheduler instead; this is for checkpoints without one and for tests.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    # Like diffusers: the training grid's smallest sigma is shifted first, then the inference grid is shifted again.
    sigma_min = float(shift_sigmas(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float64), shift))
    ts = torch.linspace(num_train_timesteps, sigma_min * num_train_timesteps, num_steps, dtype=torch.float64)
    sig = shift_sigmas((ts / num_train_timesteps).float(), shift)
    return torch.cat([sig, torch.zeros(1)]).float()


def time_shift_mu(image_seq_len: int, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15) -> float:
    """The resolution-dependent shift `mu` used by dynamic-shifting schedulers (SD3.5, Flux)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)



