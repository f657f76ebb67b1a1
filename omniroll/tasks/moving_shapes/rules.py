"""The checker's rules per category: the requirements of a prompt, each met or not (and graded) on the clip's tracks.

An actor's track is the longest track whose majority shape is the actor's (ties: the larger objects). Per actor:

- **object** (every category): it is there. A moving or changing object must be tracked in at least
  `frames - max_gap` frames (`min_cover`), an order prompt's in at least 2. Graded: the share of the frames it should
  be seen in where it is, times its outline fit min(1, IoU / FULL_IOU).
- **colour** (direction, order): its majority colour is the named one. Graded: its mean share of pixels nearest
  the colour, min(1, share / FULL_SHARE).
- **motion** (direction, two_motions), along the direction's axis with its sign s, between its first and last
  centre: the net displacement s x net >= `min_displacement` px; the other axis's at most `max_cross` x that
  (dominant); and monotone enough: at least `min_monotone` of its frame-to-frame steps not against the direction
  by more than `jitter` px. Graded: min(1, s x net / FULL_DISPLACEMENT) x min(1, monotone share / min_monotone),
  scaled down by the cross share beyond `max_cross`.
- **order** (order), on the frames where any track of each object's shape is seen: the first object is absent
  from frame 0 (it appears), the second first seen after the first, and each stays to the end once it appeared
  (seen in every frame from its first to the last: a still object is never missed by the detector, and an object
  that vanishes and comes back, as in a shuffled clip, is two tracks whose first appearance is the earlier one).
  Graded: the mean of those four checks, each persistence as the share of the frames it should be seen in.
- **start colour**, **end colour** and **one change** (change): the colour of its first tracked frame is the first
  colour, of its last the second; and the colours along the track are the first colour on >= 2 frames then the
  second on >= 2 frames, nothing else (a single switch). Graded: the first / last frame's share of the colour, and
  the mean share, over the frames, of the colour that frame should have at the best single switch.

Strict: every requirement met. Partial: the share met. Continuous: the mean graded value.
FULL_IOU, FULL_SHARE and FULL_DISPLACEMENT sit below what the renderer's own clips reach (their objects, 14-18 px, are
smaller than the pictures'; their worst frames read IoU 0.83 and colour share 0.75 over 150 moving clips; every object
travels at least 24 px), so a rendered clip earns 1.0 under every rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from omniroll.tasks.moving_shapes.grammar import Actor, ClipSpec
from omniroll.tasks.moving_shapes.track import Track
from omniroll.tasks.moving_shapes.world import DIRECTIONS
#: the outline fit, colour share and net displacement (px) at which graded credit is full (module doc)
FULL_IOU = 0.7
FULL_SHARE = 0.65
FULL_DISPLACEMENT = 20.0


@dataclass(frozen=True)
class RuleSettings:
    """min_displacement: the least net travel (px) along the direction. max_cross: the other axis's travel over
    that, at most. min_monotone: the least share of steps not against the direction. jitter: px a step may go
    against it and still count (a pause). max_gap: frames a moving or changing object may be missed."""

    min_displacement: float = 12.0
    max_cross: float = 0.5
    min_monotone: float = 0.75
    jitter: float = 1.0
    max_gap: int = 1


@dataclass(frozen=True)
class Requirement:
    """One check of a prompt: its name, whether it is met, its graded value in [0, 1], and why it failed."""

    name: str
    met: bool
    graded: float
    reason: str = ""


def actor_track(actor: Actor, tracks: list[Track]) -> Optional[Track]:
    """The actor's track (module doc), or None."""
    mine = [t for t in tracks if t.shape == actor.shape]
    if not mine:
        return None
    return max(mine, key=lambda t: (len(t.frames), np.mean([d.area for d in t.detections]), -t.first))


def _clip(x: float) -> float:
    return float(min(1.0, max(0.0, x)))


def _object(actor: Actor, tr: Optional[Track], need: int, expected: int) -> Requirement:
    name = f"{actor.shape} present"
    if tr is None:
        return Requirement(name, False, 0.0, f"no {actor.shape} tracked")
    fit = float(np.mean([min(1.0, d.iou / FULL_IOU) if d.shape == actor.shape else 0.0 for d in tr.detections]))
    graded = _clip(len(tr.frames) / expected) * fit
    if len(tr.frames) < need:
        return Requirement(name, False, graded, f"{actor.shape} tracked in {len(tr.frames)} frames, need {need}")
    return Requirement(name, True, graded)


def _colour(actor: Actor, tr: Optional[Track]) -> Requirement:
    name = f"{actor.shape} {actor.colour}"
    if tr is None:
        return Requirement(name, False, 0.0, f"no {actor.shape} for the colour {actor.colour}")
    graded = _clip(float(np.mean([d.share_of(actor.colour) for d in tr.detections])) / FULL_SHARE)
    if tr.colour != actor.colour:
        return Requirement(name, False, graded, f"{actor.shape} is {tr.colour}, expected {actor.colour}")
    return Requirement(name, True, graded)


def _motion(actor: Actor, tr: Optional[Track], s: RuleSettings) -> Requirement:
    name = f"{actor.shape} moving {actor.direction}"
    if tr is None or len(tr.frames) < 2:
        return Requirement(name, False, 0.0, f"no {actor.shape} track to move {actor.direction}")
    dx, dy = DIRECTIONS[actor.direction]
    axis, sign = (0, dx) if dx else (1, dy)
    c = tr.centres()
    net = c[-1] - c[0]
    along, across = sign * net[axis], abs(net[1 - axis])
    steps = sign * np.diff(c[:, axis])
    monotone = float(np.mean(steps >= -s.jitter))
    cross_ok = across <= s.max_cross * along
    graded = _clip(along / FULL_DISPLACEMENT) * _clip(monotone / s.min_monotone)
    if along > 0 and not cross_ok:
        graded *= s.max_cross * along / across
    if along < s.min_displacement:
        why = f"{actor.shape} moved {along:+.1f} px {actor.direction}, need {s.min_displacement:g}"
    elif not cross_ok:
        why = f"{actor.shape} moved {across:.1f} px across its direction against {along:.1f} along it"
    elif monotone < s.min_monotone:
        why = f"{actor.shape} moved {actor.direction} in only {monotone:.0%} of its steps"
    else:
        return Requirement(name, True, graded)
    return Requirement(name, False, graded, why)


def _seen(actor: Actor, tracks: list[Track]) -> list[int]:
    """The frames in which any track of the actor's shape is seen, increasing."""
    return sorted({t for tr in tracks if tr.shape == actor.shape for t in tr.frames})


def _order(first: Actor, second: Actor, tracks: list[Track], frames: int) -> Requirement:
    name = f"{first.shape} then {second.shape}"
    a, b = _seen(first, tracks), _seen(second, tracks)
    if not a or not b:
        return Requirement(name, False, 0.0, "an object of the order is missing")

    def stays(seen: list[int]) -> tuple[bool, float]:
        # seen in every frame from its first to the last (any track of its shape: an object that vanishes and comes
        # back is two tracks, and its first appearance is the earlier one)
        expected = frames - seen[0]
        return len(seen) == expected, _clip(len(seen) / expected)

    (a_stays, a_share), (b_stays, b_share) = stays(a), stays(b)
    checks = [a[0] >= 1, b[0] > a[0], a_stays, b_stays]
    graded = float(np.mean([float(checks[0]), float(checks[1]), a_share if a_stays else 0.5 * a_share,
                            b_share if b_stays else 0.5 * b_share]))
    reasons = [why for ok, why in zip(checks, (
        f"the {first.shape} is there from frame 0 (it should appear)",
        f"the {second.shape} appears at frame {b[0]}, not after the {first.shape} (frame {a[0]})",
        f"the {first.shape} does not stay to the end", f"the {second.shape} does not stay to the end")) if not ok]
    return Requirement(name, not reasons, graded, "; ".join(reasons))


def _change(actor: Actor, tr: Optional[Track]) -> list[Requirement]:
    f, t = actor.colour, actor.becomes
    names = (f"starts {f}", f"ends {t}", f"one change {f} to {t}")
    if tr is None:
        return [Requirement(n, False, 0.0, f"no {actor.shape} tracked") for n in names]
    cols = [d.colour for d in tr.detections]
    n = len(cols)
    start = Requirement(names[0], cols[0] == f, _clip(tr.detections[0].share_of(f) / FULL_SHARE),
                        "" if cols[0] == f else f"the {actor.shape} starts {cols[0]}, expected {f}")
    end = Requirement(names[1], cols[-1] == t, _clip(tr.detections[-1].share_of(t) / FULL_SHARE),
                      "" if cols[-1] == t else f"the {actor.shape} ends {cols[-1]}, expected {t}")
    best = max(range(1, n), key=lambda k: sum(cols[i] == (f if i < k else t) for i in range(n))) if n >= 2 else 0
    graded = _clip(float(np.mean([tr.detections[i].share_of(f if i < best else t) for i in range(n)])) / FULL_SHARE) \
        if n >= 2 else 0.0
    k = 0  # frames of the first colour at the start
    while k < n and cols[k] == f:
        k += 1
    single = n >= 4 and 2 <= k <= n - 2 and all(c == t for c in cols[k:])
    seq = " ".join(str(c) for c in cols)
    once = Requirement(names[2], single, graded, "" if single else f"the colours along the track are: {seq}")
    return [start, end, once]


def requirements(spec: ClipSpec, tracks: list[Track], frames: int,
                 settings: RuleSettings = RuleSettings()) -> list[Requirement]:
    """Every requirement of `spec` checked on a clip's tracks (module doc)."""
    picks = [actor_track(a, tracks) for a in spec.actors]
    cover = frames - settings.max_gap
    out: list[Requirement] = []
    if spec.tag in ("direction", "two_motions"):
        for a, tr in zip(spec.actors, picks):
            out.append(_object(a, tr, cover, frames))
            if a.colour is not None:
                out.append(_colour(a, tr))
            out.append(_motion(a, tr, settings))
    elif spec.tag == "order":
        for a, tr in zip(spec.actors, picks):
            out.append(_object(a, tr, 2, frames - tr.first if tr is not None else frames))
            out.append(_colour(a, tr))
        out.append(_order(spec.actors[0], spec.actors[1], tracks, frames))
    elif spec.tag == "change":
        out.append(_object(spec.actors[0], picks[0], cover, frames))
        out.extend(_change(spec.actors[0], picks[0]))
    else:
        raise ValueError(f"unknown tag {spec.tag!r}")
    return out
