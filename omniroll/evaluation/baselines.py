"""The frame baselines of a video evaluation: the model's own clips with their frames frozen to the first one or
shuffled (`omniroll.tasks.moving_shapes.report.score_clips` judges both per clip), tabulated per category beside the
model's strict accuracy, with the paired McNemar z of the model against each (the same clips: a clip the model passes
and its frozen frames fail counts up, the reverse down).

A model whose objects move the way the prompt says stands above both on the motion categories (direction,
two_motions); one that draws the right objects standing still passes its frozen clips as often as its own.
"""

from __future__ import annotations

import numpy as np

from omniroll.evaluation.paired import mcnemar_z
from omniroll.tasks.shapes.report import Scored, binomial_se, mean_se


def baseline_report(rows: list[Scored], tags: tuple[str, ...]) -> dict:
    """{baseline: {"categories": {tag: {"strict", "se", "n", "up", "down", "z"}}, "overall": {"strict", "se", "n"}}}
    over the rows that carry `baselines` ({} when none does): `up` clips the model passes and the baseline fails,
    `down` the reverse, `z` their McNemar z (positive: the model above its baseline). Overall: the mean of the
    categories, as `Report`'s."""
    names = list(dict.fromkeys(name for r in rows for name, _ in r.baselines))
    out = {}
    for name in names:
        cats = {}
        for tag in tags:
            pairs = [(r.strict, dict(r.baselines)[name]) for r in rows if r.tag == tag and r.baselines]
            if pairs:
                p = float(np.mean([b for _, b in pairs]))
                up = sum(m and not b for m, b in pairs)
                down = sum(b and not m for m, b in pairs)
                cats[tag] = {"strict": p, "se": binomial_se(p, len(pairs)), "n": len(pairs), "up": up, "down": down,
                             "z": mcnemar_z(up, down)}
        overall = {"strict": float(np.mean([c["strict"] for c in cats.values()])),
                   "se": mean_se([c["se"] for c in cats.values()]),
                   "n": sum(c["n"] for c in cats.values())}
        out[name] = {"categories": cats, "overall": overall}
    return out


def baseline_table(baselines: dict, report: dict) -> str:
    """A plain-text table: per category, the model's strict accuracy (%, +- se) and each baseline's on the model's
    own clips with the model's paired z against it; then the overall line."""
    names = list(baselines)
    lines = [f"the model's clips against their own frames {' / '.join(names)} (strict %; z: the model paired with "
             f"each, McNemar)",
             f"{'category':<14} {'model':>8} {'+- se':>5} " + " ".join(f"{n:>9} {'z':>6}" for n in names)]
    for tag, mine in [*report["categories"].items(), ("overall", report["overall"])]:
        theirs = [baselines[n]["overall"] if tag == "overall" else baselines[n]["categories"].get(tag) for n in names]
        if any(b is None for b in theirs):
            continue
        cells = " ".join(f"{100 * b['strict']:>9.1f} " + (f"{b['z']:>+6.2f}" if "z" in b else f"{'':>6}")
                         for b in theirs)
        lines.append(f"{tag:<14} {100 * mine['strict']:>8.1f} {100 * mine['se']:>5.1f} {cells}")
    return "\n".join(lines)
