"""Experiment: why a shapes-video model's two-motion clips fail the checker, sorted by what its tracks show.

`omniroll eval` keeps the clips it draws in the evaluation cache (`omniroll.evaluation.cache`: an entry directory
holds every clip as a film strip in `pictures.png` and their prompts and seeds in `entry.json`). This reads one or
more entries (each clip checked against its digest, as the cache reads them), judges every two-motion clip again
(the checker's detection, tracker and rules, exactly as the evaluation did) and sorts the failing ones by their long
tracks (seen on more than half of the frames):

- one long track (the two objects merged, or one of them lost for most of the clip);
- two or more, one of them without a majority shape (its shape changes from frame to frame);
- two or more, both of one asked shape (the prompt's two shapes drawn as the same one);
- two or more with a shape the prompt did not ask for;
- every asked shape tracked (the motion fails: too short or the wrong way; or a third object).

Then, for every category, how steady the long tracks' attributes are: the share of a track's frames on its most
common colour and on its most common shape, and the share of tracks whose colour holds on every frame (change clips
turn colour by design). Two-motion prompts are the only ones naming no colour.

And which side the first-named object is drawn on: over the two-motion clips whose long tracks include one of each
of the prompt's two (different) shapes, the share where the first-named shape's track lies left of the other's (the
mean x of its centres; `video_dit_longer.py --first-object-left` trains on clips drawn so, the recipe's clips put it
on either side alike).

    omniroll eval --model shapes-video --prompts train --seeds 2   # draws and keeps the clips
    .venv/bin/python benchmarks/experiments/video_two_motions_failures.py ~/.cache/omniroll/evaluations/<key>

An entry's `identity.weights` in `entry.json` names the weights that drew it. Ends with one JSON line per entry.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

import numpy as np

from omniroll.evaluation.cache import EvaluationCache
from omniroll.tasks.moving_shapes.grammar import parse_prompt
from omniroll.tasks.moving_shapes.judge import detect_frames, judge_clip
from omniroll.tasks.moving_shapes.track import centre, track

KINDS = ("pass", "one long track", "a track without a majority shape", "both drawn as one asked shape",
         "a shape not asked", "both asked shapes tracked")


def long_tracks(frames: list) -> list:
    """The tracks of a clip's detections seen on more than half of its frames."""
    return [t for t in track(frames) if len(t.frames) > len(frames) // 2]


def failure_kind(prompt: str, frames: list) -> str:
    """One of `KINDS` for a two-motion clip, given its frames' detections (`detect_frames`)."""
    spec = parse_prompt(prompt)
    if judge_clip(spec, frames).strict:
        return KINDS[0]
    long = long_tracks(frames)
    asked, got = sorted(a.shape for a in spec.actors), sorted(str(t.shape) for t in long)
    if len(long) < 2:
        return KINDS[1]
    if "None" in got:
        return KINDS[2]
    if not collections.Counter(asked) - collections.Counter(got):  # every asked shape has a track (extra ones too)
        return KINDS[5]
    if len(set(got)) == 1 and got[0] in asked:
        return KINDS[3]
    return KINDS[4]


def steadiness(prompts: list[str], detected: list) -> dict:
    """{category: {tracks, colour, shape, one_colour}}: over the long tracks of its clips (each clip's frames'
    detections in `detected`), the mean share of a track's frames on its most common colour and shape, and the share
    of tracks with one colour throughout."""
    out: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for p, frames in zip(prompts, detected):
        rows = out[parse_prompt(p).tag]
        for t in long_tracks(frames):
            n = len(t.detections)
            colour = collections.Counter(d.colour for d in t.detections).most_common(1)[0][1] / n
            rows["colour"].append(colour)
            rows["shape"].append(collections.Counter(d.shape for d in t.detections).most_common(1)[0][1] / n)
            rows["one_colour"].append(colour == 1.0)
    return {tag: {"tracks": len(r["colour"]), **{k: float(np.mean(r[k])) for k in ("colour", "shape", "one_colour")}}
            for tag, r in sorted(out.items())}


def first_named_left(prompt: str, frames: list) -> bool | None:
    """Whether the first-named shape's long track lies left of the second's (mean x of its centres); None when the
    prompt's two shapes are the same or the clip's long tracks hold not exactly one of each."""
    first, second = (a.shape for a in parse_prompt(prompt).actors)
    if first == second:
        return None
    by_shape = collections.defaultdict(list)
    for t in long_tracks(frames):
        by_shape[str(t.shape)].append(float(np.mean([centre(d)[0] for d in t.detections])))
    if len(by_shape[first]) != 1 or len(by_shape[second]) != 1:
        return None
    return by_shape[first][0] < by_shape[second][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("entries", nargs="+", help="evaluation cache entry directories (entry.json and pictures.png)")
    args = ap.parse_args()
    for entry in args.entries:
        with open(os.path.join(entry, "entry.json")) as f:
            e = json.load(f)
        if e.get("frames") is None:
            raise SystemExit(f"{entry}: an entry of pictures, not clips")
        prompts, seeds = [p["prompt"] for p in e["pictures"]], [int(p["seed"]) for p in e["pictures"]]
        clips = EvaluationCache.read(Path(entry), prompts, seeds)  # every clip checked against its sha256
        if clips is None:
            raise SystemExit(f"{entry}: unreadable, or a clip differs from its digest")
        detected = [detect_frames(c) for c in clips]  # once a clip: the sort and the steadiness read them
        kinds = collections.Counter(failure_kind(p, f) for p, f in zip(prompts, detected)
                                    if parse_prompt(p).tag == "two_motions")
        n = sum(kinds.values())
        print(f"{entry}: {n} two-motion clips (weights {e['identity']['weights'][:12]})")
        for k in KINDS:
            print(f"  {k:34s} {kinds[k]:4d}  {100 * kinds[k] / max(n, 1):5.1f} %")
        sides = [first_named_left(p, f) for p, f in zip(prompts, detected) if parse_prompt(p).tag == "two_motions"]
        left, judged = sum(x is True for x in sides), sum(x is not None for x in sides)
        print(f"  first-named shape drawn left of the other: {left} of the {judged} clips with one track of each")
        steady = steadiness(prompts, detected)
        print("  long tracks, per category: share of frames on the most common colour / shape; tracks of one colour")
        for tag, r in steady.items():
            print(f"  {tag:12s} {r['tracks']:4d} tracks  colour {r['colour']:.3f}  shape {r['shape']:.3f}  "
                  f"one colour {100 * r['one_colour']:5.1f} %")
        print(json.dumps({"entry": os.path.basename(os.path.normpath(entry)), "weights": e["identity"]["weights"],
                          "clips": n, **{k: kinds[k] for k in KINDS}, "first_named_left": left,
                          "one_track_of_each": judged, "steadiness": steady}))


if __name__ == "__main__":
    main()
