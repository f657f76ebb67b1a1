"""The moving-shapes checker: a clip judged against a prompt, from per-frame detection (the shapes world's detector)
through the tracker to the rules of its category (`rules.py`).

`score_clip(spec, clip)` = `judge_clip(spec, detect_frames(clip))`; the split lets a caller detect a clip's frames
once and judge them in another order (the cheats of `cheats.py` reorder frames, so their detections are the same
frames' detections reordered).

Besides the verdict, `extra`: the clip shows more objects than its prompt names (the detector finds more objects
than the prompt's actors in at least half of its frames). The world's scenes hold exactly the named objects, so the
renderer's clips never show one; a model that draws one more object is not failed for it by the rules (an actor's
track is still found), so a reward built on them can teach extra objects, which this counts (the shapes checker's
`Judgement.extra` for pictures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omniroll.tasks.moving_shapes.grammar import ClipSpec
from omniroll.tasks.moving_shapes.rules import RuleSettings, requirements
from omniroll.tasks.moving_shapes.track import TrackerSettings, motion, track
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld
from omniroll.tasks.shapes.detect import Detection, DetectorSettings, detect


@dataclass(frozen=True)
class ClipJudgement:
    """strict: every requirement met. partial: the share met, in [0, 1]. continuous: the mean graded value, in
    [0, 1]. reasons: why strict failed (empty on a pass). motion: the clip's mean tracked displacement in px (the
    motion meter, whatever the prompt). met: (requirement name, met) pairs. extra: more objects than the prompt
    names (module doc)."""

    strict: bool
    partial: float
    continuous: float
    motion: float
    reasons: tuple[str, ...] = ()
    met: tuple[tuple[str, bool], ...] = field(default_factory=tuple)
    extra: bool = False


def frames_hwc(clip) -> np.ndarray:
    """A clip as [T, H, W, 3] (from [T, 3, H, W], the layout of a video sample, or [T, H, W, 3]); ValueError naming
    the shape for anything else (an image is not a clip)."""
    clip = np.asarray(clip)
    if clip.ndim != 4 or 3 not in (clip.shape[1], clip.shape[3]):
        raise ValueError(f"a clip must be [T, 3, H, W] or [T, H, W, 3], got shape {tuple(clip.shape)}")
    if clip.shape[1] == 3 and clip.shape[3] != 3:
        clip = clip.transpose(0, 2, 3, 1)
    return np.ascontiguousarray(clip)


def detect_frames(clip, world: MovingWorld = DEFAULT_MOVING_WORLD,
                  settings: DetectorSettings = DetectorSettings()) -> list[list[Detection]]:
    """The shapes world's detections in each frame of a clip ([T, 3, H, W] or [T, H, W, 3] uint8)."""
    return [detect(f, world.picture, settings) for f in frames_hwc(clip)]


def judge_clip(spec: ClipSpec, frames: list[list[Detection]], tracker: TrackerSettings = TrackerSettings(),
               rules: RuleSettings = RuleSettings()) -> ClipJudgement:
    """Judge a clip's per-frame detections against a parsed prompt (module doc)."""
    if len(frames) < 2:
        raise ValueError(f"a clip needs at least 2 frames, got {len(frames)}")
    tracks = track(frames, tracker)
    reqs = requirements(spec, tracks, len(frames), rules)
    met = [r.met for r in reqs]
    return ClipJudgement(all(met), float(np.mean(met)), float(np.mean([r.graded for r in reqs])), motion(tracks),
                         tuple(r.reason for r in reqs if not r.met), tuple((r.name, r.met) for r in reqs),
                         shows_extra(spec, frames))


def shows_extra(spec: ClipSpec, frames: list[list[Detection]]) -> bool:
    """Whether the detector finds more objects than `spec` names in at least half of the frames (module doc)."""
    crowded = sum(len(detections) > len(spec.actors) for detections in frames)
    return 2 * crowded >= len(frames)


def score_clip(spec: ClipSpec, clip, world: MovingWorld = DEFAULT_MOVING_WORLD) -> ClipJudgement:
    """Judge a uint8 clip ([T, 3, H, W] or [T, H, W, 3]) against a parsed prompt."""
    return judge_clip(spec, detect_frames(clip, world))
