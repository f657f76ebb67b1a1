"""SDE windows: which denoising steps inject noise and record log-probs."""

from __future__ import annotations

from typing import Optional

import torch


def draw_sde_window(
    num_steps: int,
    window_size: Optional[int],
    window_range: Optional[tuple[int, int]],
    generator: Optional[torch.Generator],
) -> tuple[int, int]:
    """Return [start, end) of the SDE window.

    window_size None: every step but the last, (0, T - 1) (for T == 1 the single step, (0, 1)).
    Otherwise start ~ U{lo, ..., hi - size} drawn from the request's own generator, with (lo, hi) = window_range or
    (0, T - 1). The draw happens once per request, so rows packed together never share a window by accident.
    """
    if window_size is None:
        if window_range is not None:
            raise ValueError("sde_window_range needs sde_window_size")
        return (0, max(num_steps - 1, 1))
    lo, hi = window_range if window_range is not None else (0, max(num_steps - 1, 1))
    if not (0 <= lo < hi <= num_steps):
        raise ValueError(f"sde_window_range must satisfy 0 <= lo < hi <= {num_steps}, got {(lo, hi)}")
    if not (1 <= window_size <= hi - lo):
        raise ValueError(f"sde_window_size must be in [1, {hi - lo}], got {window_size}")
    start = int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator).item())
    return (start, start + window_size)
