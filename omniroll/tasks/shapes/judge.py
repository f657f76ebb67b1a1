"""GenEval's rules on the checker's detections: strict success (as GenEval scores a picture) and partial credit (the
share of the prompt's requirements met, as Flow-GRPO's GenEval reward gives it).

Strict (GenEval's `evaluate`): for each `include` requirement, take the `count` largest detections of its shape (the
checker's confidence order); there must be that many, of the required colour, each in the required relation to every
object of its target requirement; and for each `exclude` entry, fewer than `count` of that shape.

Partial credit, one term per check, averaged:
- count, per requirement: 1 - |count - found| / count, floored at 0 (Flow-GRPO's term compares with the exact count:
  the world's scenes hold exactly the prompted objects, so an extra object costs credit);
- colour, per requirement that names one: the share of its `count` largest detections that have the colour;
- position, per requirement that has one: 1 when its largest detection and its target's stand in the relation.
Flow-GRPO scores the colour and position terms only when the count is exact; here they are scored on the largest
detections whenever there are any, which gives a denser signal (a wrong count already costs its own term).

Continuous credit, the same terms graded by how nearly each is met (for RL estimators that see only a few bits per
sample in thirds):
- count: each of the `count` largest detections of the shape earns its outline fit, min(1, IoU / FULL_IOU); an extra
  object costs 1 / count, as above; floored at 0;
- colour: the mean over the `count` largest detections of the share of their pixels nearest the colour,
  min(1, share / FULL_SHARE) (a missing object earns 0);
- position: the margin m in [-1, 1] of `scene.relation_margin` (GenEval names the relation above NAMED_MARGIN, 0.5),
  graded linearly from 0 at m = -1 (the opposite side) to 1 at m = NAMED_MARGIN.
FULL_IOU and FULL_SHARE sit below the renderer's own worst (IoU 0.84, share 0.77 over 300 scenes), so a correct
picture earns 1.0 under every rule.

Extra objects: a picture shows more of a prompted shape than the prompt asks for (all its requirements of that shape
counted together), whether or not its category's strict rule fails on that (GenEval's two-object prompts allow extras).
The world's renders never do; a reward that counts badly teaches it (the hacking runs of
docs/training/rewards_that_hold.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from omniroll.tasks.shapes.detect import Detection
from omniroll.tasks.shapes.grammar import PromptSpec
from omniroll.tasks.shapes.scene import NAMED_MARGIN, relation_margin, relations

#: GenEval's POSITION_THRESHOLD
POSITION_THRESHOLD = 0.1
#: the outline fit and colour share at which continuous credit is full (see the module doc)
FULL_IOU = 0.8
FULL_SHARE = 0.75
#: the reason strict gives when an `exclude` entry fails (too many of a shape: "two circles" drawn with three gives
#: "expected circle<3, found 3"); `fails_by_exclude` reads it back, so the format lives in this file only
EXCLUDE_REASON = "expected {shape}<{count}, found {found}"
_EXCLUDE_PATTERN = re.compile(r"expected (\w+)<(\d+), found (\d+)")


@dataclass(frozen=True)
class Judgement:
    """strict: GenEval's pass / fail. partial: credit in [0, 1]. reasons: why strict failed (empty on a pass).
    continuous: the graded credit in [0, 1]. extra: more of a prompted shape than asked (the module doc)."""

    strict: bool
    partial: float
    reasons: tuple[str, ...] = field(default_factory=tuple)
    continuous: float = 0.0
    extra: bool = False


def _by_shape(detections: list[Detection]) -> dict[str, list[Detection]]:
    out: dict[str, list[Detection]] = {}
    for d in detections:  # already largest first
        if d.shape is not None:
            out.setdefault(d.shape, []).append(d)
    return out


def judge(spec: PromptSpec, detections: list[Detection]) -> Judgement:
    """Score one picture's detections against one prompt (see the module doc)."""
    objects = _by_shape(detections)
    strict, reasons, terms, graded = True, [], [], []
    groups: list = []  # per requirement: its matched objects, or None
    for req in spec.include:
        all_of = objects.get(req.shape, [])
        found = all_of[: req.count]
        terms.append(max(0.0, 1.0 - abs(req.count - len(all_of)) / req.count))
        fit = sum(min(1.0, d.iou / FULL_IOU) for d in found)
        graded.append(max(0.0, (fit - max(0, len(all_of) - req.count)) / req.count))
        matched = len(found) >= req.count
        if not matched:
            reasons.append(f"expected {req.shape}>={req.count}, found {len(found)}")
        if req.colour is not None:
            hits = sum(d.colour == req.colour for d in found)
            terms.append(hits / req.count)
            graded.append(sum(min(1.0, d.share_of(req.colour) / FULL_SHARE) for d in found) / req.count)
            if matched and hits < req.count:
                matched = False
                reasons.append(f"expected {req.colour} {req.shape}>={req.count}, found {hits} {req.colour}")
        if req.position is not None:
            rel, target = req.position
            targets = groups[target] if target < len(groups) else None
            top, target_top = all_of[:1], objects.get(spec.include[target].shape, [])[:1]
            margin = relation_margin(top[0].box, target_top[0].box, rel, POSITION_THRESHOLD) \
                if top and target_top else -1.0
            terms.append(1.0 if margin > NAMED_MARGIN else 0.0)  # where `relations` names it
            graded.append(min(1.0, max(0.0, (margin + 1.0) / (1.0 + NAMED_MARGIN))))
            if matched:
                if targets is None:
                    matched = False
                    reasons.append(f"no target for {req.shape} to be {rel}")
                elif not all(rel in relations(d.box, t.box, POSITION_THRESHOLD) for d in found for t in targets):
                    matched = False
                    reasons.append(f"expected {req.shape} {rel} target")
        strict = strict and matched
        groups.append(found if matched else None)
    for shape, count in spec.exclude:
        n = len(objects.get(shape, []))
        if n >= count:
            strict = False
            reasons.append(EXCLUDE_REASON.format(shape=shape, count=count, found=n))
    asked: dict[str, int] = {}
    for req in spec.include:
        asked[req.shape] = asked.get(req.shape, 0) + req.count
    extra = any(len(objects.get(shape, [])) > count for shape, count in asked.items())
    return Judgement(strict, sum(terms) / len(terms), tuple(reasons), sum(graded) / len(graded), extra)


def fails_by_exclude(reasons: Iterable[str]) -> bool:
    """Whether strict failed on an `exclude` entry (more of a shape than the prompt allows), read from a
    `Judgement`'s reasons or an evaluation's picture record's `reasons` (which store them as written)."""
    return any(_EXCLUDE_PATTERN.fullmatch(r) for r in reasons)
