"""A sample's randomness: seeds that depend only on what identifies the sample, never on where it sits in a batch
(`derive_seed`, `derive_group_seed`, `batch_prompt_uid`), the one generator each request draws from
(`make_generator`), and its SDE window: which denoising steps inject noise and record log-probs.

torch-free at import (`SamplingParams` validation imports `sde_window_bounds`): the functions that need torch import
it when called.
"""

from __future__ import annotations

import hashlib
from typing import Optional


_MAX = 2**63 - 1


def derive_seed(base_seed: Optional[int], global_step: int, uid: str, index: int) -> int:
    """A 63-bit seed from (base seed, trainer step, prompt-group uid, index within the group).

    sha256 of a canonical encoding, so it is stable across processes, machines and Python hash seeds, and the same
    sample gets the same seed however many workers, replicas or chunks the batch is split into.
    `base_seed=None` is treated as 0 (callers that want fresh randomness pass a random base seed).
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    key = f"omniroll/v1|{0 if base_seed is None else int(base_seed)}|{int(global_step)}|{uid}|{int(index)}"
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & _MAX


def derive_group_seed(base_seed: Optional[int], global_step: int, uid: str) -> int:
    """The seed a whole prompt group shares under `same_latent` (its initial noise and SDE window): like
    `derive_seed` without the index, in its own domain so it never equals a sample's seed by construction."""
    key = f"omniroll/v1/group|{0 if base_seed is None else int(base_seed)}|{int(global_step)}|{uid}"
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") & _MAX


def batch_prompt_uid(i: int) -> str:
    """The uid (prompt group) of the i-th prompt of a batch whose caller names none: `omniroll generate`, `omniroll
    rollout` and the HTTP `/v1/rollout` all use it, so the same prompt position, seed and settings give the same
    sample (`derive_seed(seed, global_step, batch_prompt_uid(i), j)`) whichever way it was asked for."""
    return f"prompt{int(i):05d}"


def make_generator(seed: int, device: "str | torch.device" = "cpu") -> "torch.Generator":
    """The single generator a request uses for its initial latent, its window draw and every noise draw."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


def sde_window_bounds(num_steps: int, window_size: Optional[int],
                      window_range: Optional[tuple[int, int]]) -> tuple[int, int]:
    """The range `(lo, hi)` a window of `window_size` steps is drawn from, after checking the window rules (the one
    place they are checked: `SamplingParams` validation and `draw_sde_window` both call this). ValueError names the
    field: the range must satisfy 0 <= lo < hi <= num_steps, the size must fit in it, a range needs a size."""
    if window_range is not None:
        lo, hi = window_range
        if not (0 <= lo < hi):
            raise ValueError(f"sde_window_range must be (lo, hi) with 0 <= lo < hi, got {tuple(window_range)}")
        if hi > num_steps:
            raise ValueError(f"sde_window_range hi must be <= num_inference_steps ({num_steps}), got {hi}")
        if window_size is None:
            raise ValueError("sde_window_range needs sde_window_size (the window's length within the range)")
    else:
        lo, hi = 0, max(num_steps - 1, 1)
    if window_size is not None and not (1 <= window_size <= hi - lo):
        raise ValueError(f"sde_window_size must be in [1, {hi - lo}] (the width of sde_window_range {(lo, hi)}), "
                         f"got {window_size}")
    return lo, hi


def window_for_step(schedule: str, step: int, num_steps: int, window_size: Optional[int],
                    window_range: Optional[tuple[int, int]], seed: int, advance_every: int = 1
                    ) -> Optional[tuple[int, int]]:
    """The SDE window range a trainer requests at `step` (1-based; MixGRPO's schedules; None: the sampling's own
    window), within `window_range` (lo, hi), default (0, T - 1).

    "fixed": None. "random": a start drawn from (seed, step), the window's full size. "progressive": MixGRPO's sliding
    window (`GRPOTrainingStates`, progressive with prog_overlap, prog_overlap_step 1 and roll_back): the start begins
    at lo and advances by one step every `advance_every` steps (its iters_per_group); the window is
    [start, min(start + size, hi)), so it shrinks at the range's end; when the start would reach hi it rolls back to
    lo. (The reference also visits the empty window start == hi once per cycle; here a window always holds a step.)"""
    import torch

    if schedule == "fixed":
        return None
    lo, hi = window_range or (0, max(num_steps - 1, 1))
    if schedule == "random":
        g = torch.Generator().manual_seed(seed * 7919 + step)
        start = lo + int(torch.randint(hi - lo - window_size + 1, (1,), generator=g))
        return (start, start + window_size)
    start = lo + ((step - 1) // advance_every) % (hi - lo)
    return (start, min(start + window_size, hi))


def draw_sde_window(
    num_steps: int,
    window_size: Optional[int],
    window_range: Optional[tuple[int, int]],
    generator: Optional["torch.Generator"],
) -> tuple[int, int]:
    """Return [start, end) of the SDE window.

    window_size None: every step but the last, (0, T - 1) (for T == 1 the single step, (0, 1)).
    Otherwise start ~ U{lo, ..., hi - size} drawn from the request's own generator, with (lo, hi) = window_range or
    (0, T - 1). The draw happens once per request, so rows packed together never share a window by accident.
    """
    import torch

    lo, hi = sde_window_bounds(num_steps, window_size, window_range)
    if window_size is None:
        return (lo, hi)
    device = generator.device if generator is not None else None  # a CUDA generator draws on its device
    start = int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator, device=device).item())
    return (start, start + window_size)
