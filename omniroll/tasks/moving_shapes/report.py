"""Evaluation reports of the moving-shapes world: clips scored against their prompts in the shapes world's `Scored`
rows (so `omniroll.tasks.shapes.report.Report` tabulates them), the baselines a video model must beat, and film
strips (a clip's frames left to right) for grids.

`score_clips(prompts, clips, seeds)` gives one row per clip: strict, partial credit and reasons from the checker;
`chance`, the clip judged against its prompt's antithetic twin (`twin_prompt`: the same objects with what happens in
time reversed), which is what a model that draws the right objects but ignores time would pass as often; and
`baselines`, the clip's own frames judged as the cheats of `cheats.py` rearrange them: `frozen` (the first frame
repeated) and `shuffled` (a seeded shuffle from the clip's seed; `omniroll.evaluation.baselines` tabulates them).
Each clip's frames are detected once. `film_strip(clip)` lays a clip's frames out left to right.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from omniroll.tasks.moving_shapes.cheats import cheat_order
from omniroll.tasks.moving_shapes.grammar import parse_prompt, twin_prompt
from omniroll.tasks.moving_shapes.judge import detect_frames, judge_clip
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld
from omniroll.tasks.shapes.report import Scored

#: the frame orders scored as baselines on a model's own clips (`cheats.py`)
BASELINES = ("frozen", "shuffled")


def score_clips(prompts: list[str], clips, seeds: Optional[list[int]] = None,
                world: MovingWorld = DEFAULT_MOVING_WORLD) -> list[Scored]:
    """One row per clip (uint8 [T, 3, H, W] or [T, H, W, 3]; module doc). `seeds` (default: the clip's index) seeds
    each clip's shuffle. ValueError naming the clip when one is not a clip, or a prompt outside the grammar."""
    if len(prompts) != len(clips):
        raise ValueError(f"{len(prompts)} prompts for {len(clips)} clips")
    seeds = list(range(len(clips))) if seeds is None else list(seeds)
    rows, twins = [], {}
    for i, (prompt, clip) in enumerate(zip(prompts, clips)):
        spec = parse_prompt(prompt, world)
        if spec.prompt not in twins:
            twins[spec.prompt] = parse_prompt(twin_prompt(spec.prompt, world), world)
        try:
            frames = detect_frames(clip, world)
        except ValueError as e:
            raise ValueError(f"clip {i} ({prompt!r}): {e}") from None
        j = judge_clip(spec, frames)
        rng = np.random.default_rng([int(seeds[i]) & (2 ** 63 - 1), 7])
        cheats = tuple((name, judge_clip(spec, [frames[k] for k in cheat_order(name, len(frames), rng)]).strict)
                       for name in BASELINES)
        rows.append(Scored(spec.prompt, spec.tag, j.strict, j.partial, judge_clip(twins[spec.prompt], frames).strict,
                           j.reasons, cheats, extra=j.extra))
    return rows


def film_strip(clip, gap: int = 2) -> np.ndarray:
    """uint8 [H, T W + (T - 1) gap, 3]: a clip's frames ([T, 3, H, W] or [T, H, W, 3]) left to right, `gap` white
    columns between them."""
    from omniroll.tasks.moving_shapes.judge import frames_hwc

    frames = frames_hwc(clip)
    t, h, w, _ = frames.shape
    strip = np.full((h, t * w + (t - 1) * gap, 3), 255, dtype=np.uint8)
    for k in range(t):
        strip[:, k * (w + gap):k * (w + gap) + w] = frames[k]
    return strip
