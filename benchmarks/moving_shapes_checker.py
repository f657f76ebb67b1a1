"""The moving-shapes checker measured: its time per clip, and its strict success per category on the renderer's own
clips and on each cheat (the same clips reversed in time, shuffled, frozen to the first frame), plus uniformly random
derangements of the frames (a shuffle without `cheats.py`'s monotonicity condition, to show what that condition
leaves out).

Every prompt of the grammar is rendered `--rounds` times at seeded scenes (438 clips a round); each clip's frames are
detected once (timed: the shapes detector on every frame) and judged in each order (timed: tracker and rules), as
`score_clip` would judge the reordered clip (a cheat only reorders the clip's own frames). `--shuffles` shuffles and
random derangements are drawn per clip. With `--noise SIGMA`, each clip is also judged with Gaussian noise of that
standard deviation added to every pixel (a generator's imperfect pixels; the "noisy" column, detected anew).
Printed: a table of percentages per category; the last line is JSON.

    python benchmarks/moving_shapes_checker.py                 # 1 round, 10 shuffles a clip: about a minute
    python benchmarks/moving_shapes_checker.py --rounds 3 --shuffles 20
    python benchmarks/moving_shapes_checker.py --noise 16
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
from _common import machine_info, record_loadavg

from omniroll.tasks.moving_shapes.cheats import CHEATS, cheat_order
from omniroll.tasks.moving_shapes.grammar import TAGS, all_specs
from omniroll.tasks.moving_shapes.judge import detect_frames, judge_clip
from omniroll.tasks.moving_shapes.render import render_clip
from omniroll.tasks.moving_shapes.scene import sample_clip_scene

BASE_COLUMNS = ("rendered", *CHEATS, "derangement")


def derangement(frames: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random permutation with no fixed frame."""
    while True:
        order = rng.permutation(frames)
        if (order != np.arange(frames)).all():
            return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="renders of every prompt (438 clips each)")
    parser.add_argument("--shuffles", type=int, default=10, help="shuffles and derangements drawn per clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.0, help="also judge each clip with this pixel noise (0: no)")
    args = parser.parse_args()
    if args.rounds < 1 or args.shuffles < 1 or not 0 <= args.noise <= 128:
        parser.error("--rounds and --shuffles must be >= 1, --noise in [0, 128]")
    columns = BASE_COLUMNS + (("noisy",) if args.noise else ())
    machine = machine_info(1, ("numpy",))
    rng = np.random.default_rng(args.seed)
    passed = {tag: collections.defaultdict(list) for tag in TAGS}
    detect_s, judge_s, judged, clips = 0.0, 0.0, 0, 0
    for _ in range(args.rounds):
        for spec in all_specs():
            clip = render_clip(sample_clip_scene(spec, rng))
            t0 = time.perf_counter()
            dets = detect_frames(clip)
            detect_s += time.perf_counter() - t0
            clips += 1
            T = len(dets)
            orders = [("rendered", np.arange(T))] + [(c, cheat_order(c, T, rng)) for c in ("reversed", "frozen")]
            orders += [("shuffled", cheat_order("shuffled", T, rng)) for _ in range(args.shuffles)]
            orders += [("derangement", derangement(T, rng)) for _ in range(args.shuffles)]
            for name, order in orders:
                t0 = time.perf_counter()
                j = judge_clip(spec, [dets[k] for k in order])
                judge_s += time.perf_counter() - t0
                judged += 1
                passed[spec.tag][name].append(j.strict)
            if args.noise:
                noisy = np.clip(clip + rng.normal(0.0, args.noise, clip.shape), 0, 255).astype(np.uint8)
                passed[spec.tag]["noisy"].append(judge_clip(spec, detect_frames(noisy)).strict)
    rates = {tag: {c: float(np.mean(passed[tag][c])) for c in columns} for tag in TAGS}
    counts = {tag: {c: len(passed[tag][c]) for c in columns} for tag in TAGS}
    print(f"{'category':<12}" + "".join(f"{c:>13}" for c in columns) + "   (strict success %, clips / draws)")
    for tag in TAGS:
        print(f"{tag:<12}" + "".join(f"{100 * rates[tag][c]:>8.2f} {counts[tag][c]:>4}" for c in columns))
    timing = {"detect_ms_per_clip": 1000 * detect_s / clips, "judge_ms_per_clip": 1000 * judge_s / judged,
              "clips": clips}
    print(f"checker time per clip: detection {timing['detect_ms_per_clip']:.1f} ms (every frame), tracker and "
          f"rules {timing['judge_ms_per_clip']:.2f} ms")
    record_loadavg(machine, "loadavg_end")
    print(json.dumps({"rates": rates, "counts": counts, **timing, "rounds": args.rounds, "shuffles": args.shuffles,
                      "noise": args.noise,
                      "machine": machine}))


if __name__ == "__main__":
    main()
