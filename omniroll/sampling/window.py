"""A sample's SDE window: which denoising steps inject noise and record log-probs (`draw_sde_window`, within the bounds
`sde_window_bounds` checks), and the window a trainer asks for at each step (`window_for_step`, MixGRPO's schedules).
Its seeds are sampling/seeds.py's.

torch-free at import (`SamplingParams` validation imports `sde_window_bounds`): the functions that need torch import
it when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from omniroll.sampling.seeds import window_seed

if TYPE_CHECKING:
    import torch


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
        g = torch.Generator().manual_seed(window_seed(seed, step))
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
