"""Where the trainer computes: `trainer.device`, `trainer.dtype`, `trainer.sharding`, `replicas.colocate` (and
`trainer.gradient_checkpointing`'s default), resolved and checked.

Two kinds of check, each in one place:

* `check_trainer_device(config)`: the rules the config alone decides (a device name, the dtype the rollout computes
  in, a rank's GPU reservation, what FSDP2 and colocation support). Run when a training config is validated, so a
  bad value is a `ConfigError` naming the key before anything starts.
* `check_device_here(device, dtype)`: what this machine can run (CUDA present, the index in range, bf16 supported).
  Run by the trainer before it loads anything, and by every data-parallel rank in its own process (the driver of a
  multi-node run may have no GPU at all).

The resolved values: `trainer_device`, `rank_device`, `trainer_dtype`, `gradient_checkpointing`.
"""

from __future__ import annotations

import re

from omniroll.config.algorithms import fsdp_algorithms

#: trainer.device values: the CPU, CUDA's current device, or CUDA device N
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def trainer_device(config) -> str:
    """`trainer.device`, else `engine.device`: where the update runs in the trainer's own process (world_size 1)."""
    return config.trainer.device or config.engine.device


def rank_device(config) -> str:
    """A data-parallel rank's device: `cuda` (inside the rank, the one GPU Ray reserved for it) or `cpu`."""
    return "cuda" if is_cuda(trainer_device(config)) else "cpu"


def trainer_dtype(config) -> str:
    """`trainer.dtype`, else `engine.dtype`: the frozen base's dtype and the forward's compute dtype."""
    return config.trainer.dtype or config.engine.dtype


def gradient_checkpointing(config) -> bool:
    """`trainer.gradient_checkpointing`, else on for a GPU and off for the CPU."""
    on = config.trainer.gradient_checkpointing
    return is_cuda(trainer_device(config)) if on is None else bool(on)


def is_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def check_trainer_device(config) -> None:
    """The config's device rules (module doc); ValueError naming the key and what it allows."""
    tc, rep = config.trainer, config.replicas
    key = "trainer.device" if tc.device is not None else "trainer.device (unset: engine.device)"
    device = trainer_device(config)
    # 1. The device and the dtype.
    if not DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"{key}: must be cpu, cuda or cuda:N, got {device!r}")
    if tc.dtype is not None and tc.dtype != config.engine.dtype:
        raise ValueError(f"trainer.dtype: must be engine.dtype={config.engine.dtype} (the recompute must compute "
                         f"what the rollout computed, or no ratio is near 1), got {tc.dtype}")
    # 2. Data-parallel ranks: each drives the GPU Ray reserved for it, or none.
    if tc.world_size > 1:
        if is_cuda(device) and device != "cuda":
            raise ValueError(f"{key}: with world_size > 1 every rank uses the GPU Ray reserved for it: cuda, "
                             f"not {device!r}")
        if is_cuda(device) and tc.resources.num_gpus != 1:
            raise ValueError(f"trainer.resources.num_gpus: a rank on {device} reserves its GPU: must be 1, got "
                             f"{tc.resources.num_gpus:g}")
        if not is_cuda(device) and tc.resources.num_gpus != 0:
            raise ValueError(f"trainer.resources.num_gpus: a rank on the CPU ({key}: {device}) uses no GPU: must be "
                             f"0, got {tc.resources.num_gpus:g}")
    # 3. FSDP2: full fine-tuning on ranks, the synchronous trainer.
    if tc.sharding == "fsdp":
        problems = [f"trainer.mode full (got {tc.mode})" if tc.mode != "full" else "",
                    f"trainer.world_size > 1 (got {tc.world_size})" if tc.world_size < 2 else "",
                    f"trainer.algorithm in {fsdp_algorithms()} (got {tc.algorithm})"
                    if tc.algorithm not in fsdp_algorithms() else "",
                    f"trainer.max_staleness 0 (got {tc.max_staleness})" if tc.max_staleness else "",
                    f"trainer.old_log_prob rollout (got {tc.old_log_prob})" if tc.old_log_prob != "rollout" else ""]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"trainer.sharding: fsdp needs {', '.join(problems)}")
    # 4. Colocated replicas: asleep during every update, so nothing may roll out then.
    if rep.colocate:
        if tc.max_staleness:
            raise ValueError(f"replicas.colocate: the replicas sleep during every update, so the next step cannot "
                             f"roll out meanwhile: needs trainer.max_staleness 0, got {tc.max_staleness}")
        if tc.world_size > 1:
            raise ValueError("replicas.colocate: supported with trainer.world_size 1 (the trainer's process and its "
                             f"replicas on one device), got world_size {tc.world_size}")
        if rep.sleep_level == 2 and tc.mode != "full":
            raise ValueError("replicas.sleep_level: 2 drops the replicas' denoiser weights, which only a full weight "
                             f"sync sends back: needs trainer.mode full, got {tc.mode} (use sleep_level 1)")


def check_device_here(device: str, dtype: str, key: str = "trainer.device") -> None:
    """What this machine can run (module doc); ValueError naming `key` (or trainer.dtype) otherwise."""
    import torch

    if not is_cuda(device):
        return
    if not torch.cuda.is_available():
        raise ValueError(f"{key}: {device} asked, but torch sees no CUDA device here (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda or 'not built in'}); use cpu, or run on a GPU machine")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"{key}: {device} asked, but this machine has {torch.cuda.device_count()} CUDA device(s): "
                         f"must be cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"trainer.dtype: bfloat16 is not supported by {torch.cuda.get_device_name(index)} "
                         f"(compute capability < 8.0); use float16 or float32")
