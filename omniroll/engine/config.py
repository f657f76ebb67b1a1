"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    """Knobs of one engine (one model replica).

    max_batch_size: forward rows per denoising step; a CFG request takes two rows. On CPU a forward does not get
        cheaper per row with batching, so the default is the fastest measured size, not the largest.
    batch_invariant: run linear layers in fixed row blocks so a request's output is bitwise independent of what
        else shares its batch (see `omniroll.engine.invariant`).
    prompt_cache_size: prompt encodings kept (LRU); a prompt is encoded once however many samples use it.
    decode_batch_size: finished samples decoded per VAE call.
    asleep_policy: what a request does while the engine sleeps: "error" raises, "wait" waits for wake_up.
    weight_update: how a full weight update lands. "staged": received and checked into a copy while the engine keeps
        serving, then swapped in between two steps (a failed update changes nothing; costs one extra copy of the
        denoiser on its device during the update). "in_place": no extra memory; the engine stops serving first, and
        an update that fails midway leaves it refusing requests until a complete update lands.
    prefix_sharing: run the common ODE prefix of samples that share `latent_seed` (and prompt, shape, schedule,
        guidance) once per group and fork it at the SDE window's start (see `omniroll.engine.prefix`).
    max_prompt_chars: the longest prompt (and negative prompt) accepted, in characters; longer ones are refused at
        submission, naming the request, before any encoding. Default 8192: T5 reads at most 512 tokens (a few
        thousand characters of English); text past that is truncated anyway, and tokenizing megabytes on the engine
        thread would stall every other request.
    num_threads: torch intra-op threads for this process (None leaves torch's setting). CPU kernels (oneDNN
        convolutions in particular) can pick other algorithms at another thread count, so engines that must give
        bitwise-identical samples (replicas of one rollout) must run with the same num_threads.
    """

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch_size: int = 16
    batch_invariant: bool = True
    invariant_block_rows: int = 64
    prompt_cache_size: int = 1024
    decode_batch_size: int = 8
    asleep_policy: str = "error"
    num_threads: int | None = None
    weight_update: str = "staged"
    prefix_sharing: bool = True
    max_prompt_chars: int = 8192

    def __post_init__(self):
        if self.max_batch_size < 2:
            raise ValueError(f"max_batch_size must be >= 2 (one CFG request takes two rows), got {self.max_batch_size}")
        if self.invariant_block_rows < 1:
            raise ValueError(f"invariant_block_rows must be >= 1, got {self.invariant_block_rows}")
        if self.prompt_cache_size < 1:
            raise ValueError(f"prompt_cache_size must be >= 1, got {self.prompt_cache_size}")
        if self.decode_batch_size < 1:
            raise ValueError(f"decode_batch_size must be >= 1, got {self.decode_batch_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.weight_update not in ("staged", "in_place"):
            raise ValueError(f"weight_update must be 'staged' or 'in_place', got {self.weight_update!r}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.asleep_policy not in ("error", "wait"):
            raise ValueError(f"asleep_policy must be 'error' or 'wait', got {self.asleep_policy!r}")
