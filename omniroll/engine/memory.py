"""A device as a process sees it: which physical device it is (`device_identity`) and the most memory this process
allocated on it since the last reading (`peak_bytes`). The replicas report both for the rollout, the trainer for its
own stages (omniroll/train/report/stage_memory.py); only CUDA reports memory, the CPU reports none (None)."""

from __future__ import annotations

from typing import Optional

import torch


def device_identity(device: str | torch.device) -> str:
    """"cpu", or the GPU's UUID (two processes on one physical GPU see the same, whatever their device index)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def peak_bytes(device: str | torch.device, reset: bool = True) -> Optional[int]:
    """The peak memory this process allocated on `device` since the last reset (then reset it, when `reset`); None
    where the device reports none (the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_allocated(device))
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak
