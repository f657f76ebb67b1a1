"""The tracker: each object of a clip linked across frames, from the shapes world's per-frame detections.

Frame by frame, every detection is linked to the track it is nearest (box centres), greedily nearest pair first,
when it lies within `max_jump` px per frame since the track was last seen; a track may miss `max_gap` frames and
still be linked (a frame where the detector missed the object); a detection left over starts a new track. A track's
shape and colour are the majority over its frames (a shape or colour on at most half of them: None).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from omniroll.tasks.shapes.detect import Detection


@dataclass(frozen=True)
class TrackerSettings:
    """max_jump: the farthest (px) an object may move from one frame to the next and stay one track (the world's
    objects move at most 5 px a frame). max_gap: frames a track may miss and still continue."""

    max_jump: float = 16.0
    max_gap: int = 1


def centre(d: Detection) -> tuple[float, float]:
    """A detection's box centre (x, y) in pixels."""
    x0, y0, x1, y1 = d.box
    return ((x0 + x1) / 2, (y0 + y1) / 2)


def _majority(values: list) -> Optional[object]:
    counts = collections.Counter(v for v in values if v is not None)
    if not counts:
        return None
    value, n = counts.most_common(1)[0]
    return value if n > len(values) / 2 else None


@dataclass
class Track:
    """One object through the clip: the frames it was seen in (increasing) and its detection in each."""

    frames: list[int] = field(default_factory=list)
    detections: list[Detection] = field(default_factory=list)

    @property
    def first(self) -> int:
        return self.frames[0]

    @property
    def last(self) -> int:
        return self.frames[-1]

    @property
    def shape(self) -> Optional[str]:
        """The shape on more than half of its frames (else None)."""
        return _majority([d.shape for d in self.detections])

    @property
    def colour(self) -> Optional[str]:
        """The colour on more than half of its frames (else None)."""
        return _majority([d.colour for d in self.detections])

    def centres(self) -> np.ndarray:
        """[n, 2] float: (x, y) of each frame it was seen in."""
        return np.asarray([centre(d) for d in self.detections], dtype=np.float64)

    def displacement(self) -> float:
        """The straight-line distance (px) between its first and its last centre."""
        c = self.centres()
        return float(np.hypot(*(c[-1] - c[0])))


def track(frames: list[list[Detection]], settings: TrackerSettings = TrackerSettings()) -> list[Track]:
    """The tracks of a clip's per-frame detections (module doc), in the order they started."""
    tracks: list[Track] = []
    for t, detections in enumerate(frames):
        alive = [k for k, tr in enumerate(tracks) if t - tr.last <= settings.max_gap + 1]
        pairs = []
        for k in alive:
            tx, ty = centre(tracks[k].detections[-1])
            reach = settings.max_jump * (t - tracks[k].last)
            for j, d in enumerate(detections):
                x, y = centre(d)
                dist = float(np.hypot(x - tx, y - ty))
                if dist <= reach:
                    pairs.append((dist, k, j))
        used_tracks, used_dets = set(), set()
        for _, k, j in sorted(pairs):
            if k in used_tracks or j in used_dets:
                continue
            used_tracks.add(k)
            used_dets.add(j)
            tracks[k].frames.append(t)
            tracks[k].detections.append(detections[j])
        for j, d in enumerate(detections):
            if j not in used_dets:
                tracks.append(Track([t], [d]))
    return tracks


def motion(tracks: list[Track]) -> float:
    """The clip's motion meter: the mean displacement (px) of its tracks seen in at least two frames (0.0 when it
    has none: an empty or a still clip reads 0)."""
    moved = [tr.displacement() for tr in tracks if len(tr.frames) >= 2]
    return float(np.mean(moved)) if moved else 0.0
