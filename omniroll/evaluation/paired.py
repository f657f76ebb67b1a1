"""The paired comparison of two evaluations at the same prompts and seeds: which pictures flipped, McNemar's z, a
verdict.

Two evaluations of the same prompts at the same seeds draw from the same initial noise, so most pictures keep their
verdict and only the flipped ones carry information about the change: U pictures went fail -> pass ("up"), D went
pass -> fail ("down"). McNemar's statistic z = (U - D) / sqrt(U + D) is about standard normal when the change does
nothing, so |z| < 2 reads "no detectable change", whatever the two means say (any LoRA update flips 10-20 % of the
shapes world's pictures both ways). Reported per category and overall (all pictures pooled). A continuous score
(a reward) at the same prompts and seeds compares by `paired_z`, the paired t statistic of its per-sample differences.

    cmp = paired(base_pictures, new_pictures)   # lists of {"prompt", "seed", "strict", "tag"} (an eval.json's pictures)
    cmp["overall"]  -> {"up": U, "down": D, "n": pairs, "z": z, "verdict": ...}
    verdict(cmp["overall"]["z"])  -> "no detectable change" | "detectably better" | "detectably worse"

Where the checker also judged extra objects (every picture has `extra`), `extra_objects(base, new)` pairs them the
same way: the share with an extra object before and after, the pictures that gained one and lost one, McNemar's z of
the two; and the verdict "strict with no extra object" (`clean`), the change a reward that extra objects fool cannot
fake.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Optional, Sequence

#: |z| at and above which a paired difference counts as detectable (about a 5 % two-sided false-alarm rate)
DETECTABLE_Z = 2.0


def mcnemar_z(up: int, down: int) -> float:
    """(U - D) / sqrt(U + D); 0.0 when no picture flipped."""
    return (up - down) / math.sqrt(up + down) if up + down else 0.0


def paired_z(before: Sequence[float], after: Sequence[float]) -> float:
    """The paired z of a continuous score at the same prompts and seeds: the mean per-sample difference d = after -
    before over its standard error, mean(d) / (std(d) / sqrt(n)) with the sample std (n - 1), a paired t statistic
    read against |z| >= DETECTABLE_Z. 0.0 when every difference is 0 (or n < 2); +-inf when every difference is the
    same nonzero number."""
    if len(before) != len(after):
        raise ValueError(f"a paired z needs the same samples on both sides: {len(before)} before, {len(after)} after")
    d = [float(b) - float(a) for a, b in zip(before, after)]
    n = len(d)
    if n < 2:
        return 0.0
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0.0:
        return 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    return mean / (sd / math.sqrt(n))


def verdict(z: float) -> str:
    """"no detectable change" when |z| < DETECTABLE_Z, else "detectably better" or "detectably worse"."""
    if abs(z) < DETECTABLE_Z:
        return "no detectable change"
    return "detectably better" if z > 0 else "detectably worse"


def picture_key(picture: Mapping) -> tuple[str, int]:
    return str(picture["prompt"]), int(picture["seed"])


def strict_verdict(picture: Mapping) -> bool:
    return bool(picture["strict"])


def clean_verdict(picture: Mapping) -> bool:
    """Strict, and no extra object (`extra`)."""
    return bool(picture["strict"]) and not picture["extra"]


def flips(base: Iterable[Mapping], new: Iterable[Mapping],
          verdict_of: Callable[[Mapping], bool] = strict_verdict) -> dict[tuple[str, int], str]:
    """{(prompt, seed): "up" | "down"} for the pictures whose verdict (default: strict) changed from `base` to `new`.
    ValueError when the two do not hold the same (prompt, seed) pairs: a paired comparison needs the same pictures."""
    b = {picture_key(p): verdict_of(p) for p in base}
    n = {picture_key(p): verdict_of(p) for p in new}
    if b.keys() != n.keys():
        only_b, only_n = sorted(b.keys() - n.keys()), sorted(n.keys() - b.keys())
        raise ValueError(f"a paired comparison needs the same prompts and seeds on both sides: {len(only_b)} "
                         f"picture(s) only in the baseline (e.g. {only_b[:2]}), {len(only_n)} only in the other "
                         f"(e.g. {only_n[:2]})")
    return {k: ("up" if n[k] else "down") for k in b if b[k] != n[k]}


def common_pictures(a: Iterable[Mapping], b: Iterable[Mapping]) -> tuple[list, list]:
    """The pictures of `a` and of `b` at the (prompt, seed) pairs both hold (an evaluation at fewer seeds per prompt
    draws a subset of another's: seeds 0 .. N-1 of every prompt)."""
    a, b = list(a), list(b)
    keys = {picture_key(p) for p in a} & {picture_key(p) for p in b}
    return [p for p in a if picture_key(p) in keys], [p for p in b if picture_key(p) in keys]


def paired(base: Iterable[Mapping], new: Iterable[Mapping],
           verdict_of: Callable[[Mapping], bool] = strict_verdict) -> dict:
    """Per category (the pictures' `tag`) and overall: up, down, n (pairs), z and the verdict (of `verdict_of`,
    default strict)."""
    base, new = list(base), list(new)
    changed = flips(base, new, verdict_of)
    tag_of = {picture_key(p): str(p["tag"]) for p in new}

    def part(keys: list) -> dict:
        up = sum(changed.get(k) == "up" for k in keys)
        down = sum(changed.get(k) == "down" for k in keys)
        z = mcnemar_z(up, down)
        return {"up": up, "down": down, "n": len(keys), "z": z, "verdict": verdict(z)}

    tags = list(dict.fromkeys(tag_of.values()))
    return {"overall": part(list(tag_of)),
            "categories": {t: part([k for k, g in tag_of.items() if g == t]) for t in tags}}


def extra_objects(base: Iterable[Mapping], new: Iterable[Mapping]) -> Optional[dict]:
    """Extra objects paired (module doc): {"before", "after": the shares with one, "gained", "lost": pictures,
    "z": McNemar's z of gained against lost, "n", "clean": `paired` overall of strict with no extra object}; None
    when a picture on either side was not judged for extra objects."""
    base, new = list(base), list(new)
    if not all(p.get("extra") is not None for p in base + new):
        return None
    cmp = paired(base, new, verdict_of=lambda p: bool(p["extra"]))["overall"]
    n = cmp["n"]
    return {"before": sum(bool(p["extra"]) for p in base) / n, "after": sum(bool(p["extra"]) for p in new) / n,
            "gained": cmp["up"], "lost": cmp["down"], "z": cmp["z"], "n": n,
            "clean": paired(base, new, verdict_of=clean_verdict)["overall"]}


def extra_objects_line(extra: Mapping, noun: str = "picture") -> str:
    """"extra objects: B % -> A % of pictures (G gained one, L lost one, McNemar z = ..); strict with no extra object:
    <verdict line>"."""
    return (f"extra objects: {100 * extra['before']:.1f} % -> {100 * extra['after']:.1f} % of {noun}s "
            f"({extra['gained']} gained one, {extra['lost']} lost one, McNemar z = {extra['z']:+.2f}); strict with no "
            f"extra object: {verdict_line(extra['clean'], noun)}")


def paired_table(cmp: dict, base_report: Mapping, new_report: Mapping, title: str = "", noun: str = "picture") -> str:
    """A plain-text table: per category and overall, the two strict accuracies (%) with their standard errors, the
    pictures (or clips: `noun`) up and down and z; then the verdict line."""
    lines = [title] if title else []
    lines.append(f"{'category':<14} {'base %':>7} {'+- se':>5} {'new %':>7} {'+- se':>5} {'up':>4} {'down':>5} "
                 f"{'z':>6}")
    rows = [(t, base_report["categories"][t], new_report["categories"][t], c) for t, c in cmp["categories"].items()
            if t in base_report["categories"] and t in new_report["categories"]]
    rows.append(("overall", base_report["overall"], new_report["overall"], cmp["overall"]))
    for name, b, n, c in rows:
        lines.append(f"{name:<14} {100 * b['strict']:>7.1f} {100 * b['se']:>5.1f} {100 * n['strict']:>7.1f} "
                     f"{100 * n['se']:>5.1f} {c['up']:>4} {c['down']:>5} {c['z']:>+6.2f}")
    o = cmp["overall"]
    lines.append(verdict_line(o, noun))
    return "\n".join(lines)


def verdict_line(overall: Mapping, noun: str = "picture") -> str:
    """"<verdict>: U picture(s) fail -> pass, D pass -> fail, McNemar z = .. (detectable at |z| >= 2)" (`noun`:
    "clip" for clips)."""
    return (f"{overall['verdict']}: {overall['up']} {noun}(s) fail -> pass, {overall['down']} pass -> fail of "
            f"{overall['n']}, McNemar z = {overall['z']:+.2f} (detectable at |z| >= {DETECTABLE_Z:g})")
