"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

MAX_BATCH_ROWS = 4096


def torch_dtype(name: str) -> torch.dtype:
    """A compute dtype's name (`engine.params.DTYPE_NAMES`) -> torch's dtype; ValueError naming the allowed ones."""
    from omniroll.engine.params import DTYPE_NAMES

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    return getattr(torch, name)


def check_max_batch_size(value: Any, name: Optional[str] = "max_batch_size"):
    """The one `max_batch_size` rule (engine, YAML `engine.max_batch_size`, CLI `--max-batch-size`): an int in
    [2, 4096] (a CFG request takes two rows) or "auto". Returns it; ValueError (starting with `name:` when given)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 2 <= value <= MAX_BATCH_ROWS):
        return value
    why = f"must be an int in [2, {MAX_BATCH_ROWS}] (a CFG sample takes 2 rows) or 'auto', got {value!r}"
    raise ValueError(f"{name} {why}" if name else why)


@dataclass
class EngineConfig:
    """Knobs of one engine (one model replica).

    device: the torch device every module of the model is placed on (`cpu`, `cuda`, `cuda:N`).
    dtype: the dtype of the weights and the forwards; the SDE step, the recorded latents and the log-probs are fp32
        whatever it is.
    max_batch_size: forward rows per denoising step and batch key (latent shape and text length); a CFG request takes
        two rows. "auto": measured per batch key at its first request (a calibration of a few forwards, ~1-5 s,
        cached on disk per model, shape and thread count; see `omniroll.engine.calibrate`), the row count with the
        lowest cost per row. The default, 16, is the rule for CPU: the cost per row is flat from 8 to 16 rows and
        ~10% higher at 32 (measured: docs/benchmarks.md); on a GPU use "auto".
    batch_invariant: run linear layers in fixed row blocks so a request's output is bitwise independent of what
        else shares its batch (see `omniroll.engine.runner`). None (default): on for CPU, where it is measured
        and tested, off for other devices, where it is not verified (cuBLAS / cuDNN pick kernels by shape, so
        padding rows does not pin one kernel; see docs/concepts.md, "Device state and batch invariance").
    invariant_block_rows: in batch-invariant mode, the rows of every linear layer's input are zero-padded to a
        multiple of this before the matmul (the padding is sliced off), so the kernel runs on a row count that does
        not change with the batch (see `omniroll.engine.execution`). Recorded in every trajectory: the trainer's
        recompute uses the rollout's value.
    prompt_cache_size: prompt encodings kept (LRU); a prompt is encoded once however many samples use it.
    decode_batch_size: finished samples decoded per VAE call. The default, 2, is the CPU rule: on the bench SD3 at
        256 px a block of 2 cost the least per image on a quiet 2-core machine (0.135 s vs 0.14 at 1 and 0.16 at 4;
        docs/benchmarks.md); on a GPU, where a larger block fills the device, raise it. In batch-invariant mode
        every call decodes exactly this many (zero-padded), so, like num_threads, it is part of what makes a sample's
        pixels: replicas of one rollout must share it. A partial block waits up to this many steps for more finished
        samples while other requests run.
    asleep_policy: what a request does while the engine sleeps: "error" raises, "wait" waits for wake_up.
    weight_update: how a full weight update lands. "staged": received and checked into a copy while the engine keeps
        serving, then swapped in between two steps (a failed update changes nothing; costs one extra copy of the
        denoiser on its device during the update). "in_place": no extra memory; the engine stops serving first, and
        an update that fails midway leaves it refusing requests until a complete update lands.
    prefix_sharing: run the common ODE prefix of samples that share `latent_seed` (and prompt, shape, schedule,
        guidance) once per group and fork it at the SDE window's start, and a tree rollout's common noise path once
        per node, forked at each `noise_seeds` step (see `omniroll.engine.prefix_tree`).
    max_prompt_chars: the longest prompt (and negative prompt) accepted, in characters; longer ones are refused at
        submission, naming the request, before any encoding. Default 8192: T5 reads at most 512 tokens (a few
        thousand characters of English); text past that is truncated anyway, and tokenizing megabytes on the engine
        thread would stall every other request.
    max_waiting: the requests that may wait to start (queued, not yet admitted); a call that would pass it is refused
        whole with `EngineOverloadedError`, nothing queued. A waiting request holds its parameters and prompt, no
        latent (its state is built at admission), so the bound is about the queue's length, not its memory: 8192
        is two steps of a 256-prompt x 16-sample batch on one replica.
    merge_lora: keep a LoRA adapter merged into the denoiser's weights (`omniroll.weights.lora_merge`): the forward
        runs at the base model's cost (unmerged, a rank-16 adapter on every linear of the shapes model's transformer
        costs 1.35-1.55x it on 2 CPU cores), for one more copy of the adapted layers' weights on the device; the base
        weights are handed back untouched before every update. Merged samples agree with unmerged ones to rounding,
        not bitwise (in bf16 the merged weights are rounded to bf16, as diffusers' `fuse_lora` does: a coarser
        agreement than fp32's), so the trainer's recompute (the adapter unmerged) no longer reproduces the rollout's
        log-probs: for algorithms that take no ratio (`trainer.algorithm` nft, awm) and for evaluation. Recorded in
        every trajectory (`execution`); replicas of one rollout must share it.
    num_threads: torch intra-op threads for this process (None leaves torch's setting). CPU kernels (oneDNN
        convolutions in particular) can pick other algorithms at another thread count, so engines that must give
        bitwise-identical samples (replicas of one rollout) must run with the same num_threads.
    row_threads: threads that share each denoising step's rows (and a decode's VAE blocks), each running its share as
        its own forward at one torch thread (`omniroll.engine.row_threads`); 1 (default): one forward a step on the
        torch intra-op threads. Above 1 the process runs torch at one thread (num_threads must be unset or 1). On a
        small model on CPU this uses the cores better than intra-op threads (measured: docs/benchmarks.md). In
        batch-invariant mode a sample's bits are an engine's at num_threads 1, whatever row_threads is (a replica with
        row threads and one at num_threads 1 draw the same samples); not batch-invariant, a step's split moves a
        sample's last bits. `max_batch_size` stays the rows of one step, split among the threads.
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch_size: int | str = 16
    batch_invariant: bool | None = None
    invariant_block_rows: int = 64
    prompt_cache_size: int = 1024
    decode_batch_size: int = 2
    asleep_policy: str = "error"
    num_threads: int | None = None
    row_threads: int = 1
    merge_lora: bool = False
    weight_update: str = "staged"
    prefix_sharing: bool = True
    max_prompt_chars: int = 8192
    max_waiting: int = 8192

    def __post_init__(self):
        if self.batch_invariant is None:
            self.batch_invariant = torch.device(self.device).type == "cpu"
        check_max_batch_size(self.max_batch_size)
        if self.invariant_block_rows < 1:
            raise ValueError(f"invariant_block_rows must be >= 1, got {self.invariant_block_rows}")
        if self.prompt_cache_size < 1:
            raise ValueError(f"prompt_cache_size must be >= 1, got {self.prompt_cache_size}")
        if self.decode_batch_size < 1:
            raise ValueError(f"decode_batch_size must be >= 1, got {self.decode_batch_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if isinstance(self.row_threads, bool) or not isinstance(self.row_threads, int) or \
                not 1 <= self.row_threads <= 256:
            raise ValueError(f"row_threads must be an int in [1, 256], got {self.row_threads!r}")
        if self.row_threads > 1 and self.num_threads not in (None, 1):
            raise ValueError(f"num_threads must be unset or 1 when row_threads > 1 (each row thread runs one torch "
                             f"thread), got num_threads={self.num_threads} with row_threads={self.row_threads}")
        if self.weight_update not in ("staged", "in_place"):
            raise ValueError(f"weight_update must be 'staged' or 'in_place', got {self.weight_update!r}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1, got {self.max_waiting!r}")
        if not isinstance(self.merge_lora, bool):
            raise ValueError(f"merge_lora must be true or false, got {self.merge_lora!r}")
        if self.asleep_policy not in ("error", "wait"):
            raise ValueError(f"asleep_policy must be 'error' or 'wait', got {self.asleep_policy!r}")
