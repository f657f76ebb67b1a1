"""GenEval-style reports of the shapes world: pictures scored against their prompts, tabulated per category, with a
chance baseline, and a captioned grid of pictures.

`score_pictures(prompts, pictures)` gives one `Scored` row per picture. `Report.from_rows(rows)` tabulates them:
strict accuracy per category (the share of its pictures that pass) with its standard error (`se`: the binomial
sqrt(p (1 - p) / n) of the category's n pictures), overall = the mean of the category accuracies (GenEval's overall
score) with its standard error (sqrt(sum of the categories' se^2) / categories), the mean partial credit, and the
chance baseline: the same pictures scored against
another prompt of their category with a different requirement (the next one in the grammar's order), which is what
a model that ignores the prompt's details would score; and, when prompts have several pictures, the share of prompts
whose pictures do not all earn the same partial credit (`varied_prompts`: a GRPO group of such a prompt has a
learning signal); and the share of pictures with more of a prompted shape than asked (`extra_objects`, for rows the
shapes checker judged).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import numpy as np

from omniroll.tasks.shapes.detect import detect
from omniroll.tasks.shapes.grammar import TAGS, PromptSpec, all_prompts, parse_prompt
from omniroll.tasks.shapes.judge import Judgement, judge
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World


@dataclass(frozen=True)
class Scored:
    prompt: str
    tag: str
    strict: bool
    partial: float
    chance: bool  # strict against the chance prompt
    reasons: tuple[str, ...] = ()
    baselines: tuple[tuple[str, bool], ...] = ()  # (baseline, strict) pairs: a clip's frames frozen, shuffled
    # extra objects (a picture: more of a prompted shape than asked, `Judgement.extra`; a clip: more objects than its
    # prompt names, `ClipJudgement.extra`); None: not judged
    extra: Optional[bool] = None


def chance_prompt(spec: PromptSpec, world: World = DEFAULT_WORLD) -> str:
    """The next prompt of `spec`'s category (in the grammar's order, wrapping) whose requirement differs."""
    same = [p for p in all_prompts(world) if parse_prompt(p, world).tag == spec.tag]
    start = same.index(spec.prompt) if spec.prompt in same else 0
    for k in range(1, len(same) + 1):
        q = same[(start + k) % len(same)]
        if parse_prompt(q, world).key != spec.key:
            return q
    raise ValueError(f"category {spec.tag!r} has a single requirement: no chance prompt")


def hwc(picture) -> np.ndarray:
    """A picture as a contiguous [H, W, 3] array (the engine's pictures are [3, H, W])."""
    picture = np.asarray(picture)
    if picture.ndim == 3 and picture.shape[0] == 3 and picture.shape[2] != 3:
        picture = picture.transpose(1, 2, 0)
    return np.ascontiguousarray(picture)


def score_picture(spec: PromptSpec, picture, world: World = DEFAULT_WORLD) -> Judgement:
    """Judge an [H, W, 3] uint8 picture (or [3, H, W]) against a parsed prompt."""
    return judge(spec, detect(hwc(picture), world))


def score_pictures(prompts: list[str], pictures, world: World = DEFAULT_WORLD) -> list[Scored]:
    if len(prompts) != len(pictures):
        raise ValueError(f"{len(prompts)} prompts for {len(pictures)} pictures")
    rows, chance_of = [], {}  # prompt -> its chance prompt's spec (finding one parses the whole grammar)
    for prompt, pic in zip(prompts, pictures):
        spec = parse_prompt(prompt, world)
        if spec.prompt not in chance_of:
            chance_of[spec.prompt] = parse_prompt(chance_prompt(spec, world), world)
        dets = detect(hwc(pic), world)
        j = judge(spec, dets)
        c = judge(chance_of[spec.prompt], dets)
        rows.append(Scored(spec.prompt, spec.tag, j.strict, j.partial, c.strict, j.reasons, extra=j.extra))
    return rows


#: what a picture's `extra` counts, in a report's words
EXTRA_LABEL = "pictures with more of a prompted shape than asked"


def binomial_se(p: float, n: int) -> float:
    """The standard error sqrt(p (1 - p) / n) of a pass rate p measured on n pictures (0 pictures: nan)."""
    return math.sqrt(p * (1 - p) / n) if n > 0 else float("nan")


def mean_se(ses: list[float]) -> float:
    """The standard error of a mean of independent estimates with standard errors `ses` (none: nan): the overall
    accuracy's, as the mean of the categories'."""
    return math.sqrt(sum(se ** 2 for se in ses)) / len(ses) if ses else float("nan")


@dataclass
class Report:
    """Per category: strict accuracy, its standard error, partial credit, chance and the number of pictures; overall:
    their means over the categories present, and the standard error of that mean (module doc)."""

    categories: dict[str, dict] = field(default_factory=dict)
    overall: dict = field(default_factory=dict)
    extra_label: str = EXTRA_LABEL  # what `extra_objects` counts, in the table's words

    @classmethod
    def from_rows(cls, rows: list[Scored], tags: tuple[str, ...] = TAGS, extra_label: str = EXTRA_LABEL) -> "Report":
        """The report of `rows`, its categories in the order of `tags` (default: the shapes world's; the
        moving-shapes world passes its own, and the words for its extra objects)."""
        cats = {}
        for tag in tags:
            mine = [r for r in rows if r.tag == tag]
            if mine:
                strict = float(np.mean([r.strict for r in mine]))
                cats[tag] = {"strict": strict, "se": binomial_se(strict, len(mine)),
                             "partial": float(np.mean([r.partial for r in mine])),
                             "chance": float(np.mean([r.chance for r in mine])), "n": len(mine)}
        overall = {k: float(np.mean([c[k] for c in cats.values()])) if cats else float("nan")
                   for k in ("strict", "partial", "chance")}
        overall["se"] = mean_se([c["se"] for c in cats.values()])
        overall["n"] = len(rows)
        by_prompt: dict[str, list[float]] = {}
        for r in rows:
            by_prompt.setdefault(r.prompt, []).append(r.partial)
        groups = [v for v in by_prompt.values() if len(v) > 1]
        # what GRPO needs: prompts whose pictures do not all earn the same reward
        overall["varied_prompts"] = float(np.mean([len(set(v)) > 1 for v in groups])) if groups else float("nan")
        judged = [r.extra for r in rows if r.extra is not None]
        if judged:  # a reward that counts badly teaches extra objects (module doc of omniroll.tasks.shapes.judge)
            overall["extra_objects"] = float(np.mean(judged))
        return cls(cats, overall, extra_label)

    def to_dict(self) -> dict:
        return {"categories": self.categories, "overall": self.overall}

    def flat(self, prefix: str) -> dict[str, float]:
        """`{prefix}/strict`, `{prefix}/<tag>/strict`, `{prefix}/varied_prompts`, ...: for metrics.jsonl and the
        trackers."""
        out = {f"{prefix}/{k}": v for k, v in self.overall.items() if k != "n"}
        for tag, c in self.categories.items():
            out.update({f"{prefix}/{tag}/{k}": v for k, v in c.items() if k != "n"})
        return out

    def table(self, title: str = "") -> str:
        """A plain-text table (percentages), one line per category and the overall line."""
        lines = [title] if title else []
        lines.append(f"{'category':<14} {'strict %':>8} {'+- se':>6} {'partial':>8} {'chance %':>8} {'images':>7}")
        for tag, c in self.categories.items():
            lines.append(f"{tag:<14} {100 * c['strict']:>8.1f} {100 * c['se']:>6.1f} {c['partial']:>8.3f} "
                         f"{100 * c['chance']:>8.1f} {c['n']:>7}")
        o = self.overall
        lines.append(f"{'overall':<14} {100 * o['strict']:>8.1f} {100 * o['se']:>6.1f} {o['partial']:>8.3f} "
                     f"{100 * o['chance']:>8.1f} {o['n']:>7}")
        if not math.isnan(o.get("varied_prompts", math.nan)):  # some prompt has several pictures
            lines.append(f"prompts whose pictures earn different rewards (GRPO's signal): "
                         f"{100 * o['varied_prompts']:.0f} %")
        if "extra_objects" in o:
            lines.append(f"{self.extra_label}: {100 * o['extra_objects']:.1f} %")
        return "\n".join(lines)


@lru_cache(maxsize=8)
def caption_font(size: int = 11):
    """DejaVu Sans at `size` px from matplotlib's own fonts when present (readable at small sizes), else PIL's
    default (also the trainer's validation grids)."""
    from PIL import ImageFont

    try:
        import matplotlib

        return ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), size)
    except (ImportError, OSError):
        return ImageFont.load_default()


def wrap(text: str, font, width: int) -> list[str]:
    """Greedy word wrap of `text` to lines of at most `width` px in `font` (a word longer than a line is split;
    also the trainer's validation grids)."""
    pieces: list[str] = []
    for word in text.split():
        while len(word) > 1 and font.getlength(word) > width:
            cut = next((i for i in range(len(word) - 1, 0, -1) if font.getlength(word[:i]) <= width), 1)
            pieces.append(word[:cut])
            word = word[cut:]
        pieces.append(word)
    lines: list[str] = []
    for piece in pieces:
        if lines and font.getlength(f"{lines[-1]} {piece}") <= width:
            lines[-1] = f"{lines[-1]} {piece}"
        else:
            lines.append(piece)
    return lines or [""]


#: the marks of a flipped picture (`captioned_grid`'s `marks`): a glyph and a frame colour (blue and orange: told
#: apart with every common colour-vision deficiency; the glyph says it without colour)
FLIP_MARKS = {"up": ("\u25b2", (0, 90, 200)), "down": ("\u25bc", (230, 120, 0))}


def captioned_grid(pictures, captions: list[str], passed: list[bool] | None = None, columns: int = 8,
                   scale: int = 2, marks: list | None = None) -> np.ndarray:
    """uint8 [H, W, 3]: the pictures (HWC or CHW; None leaves a cell blank) in rows of `columns`, each enlarged
    `scale` times above its caption (wrapped to three lines). With `passed`, the caption starts with a check mark
    and is green for a pass, a cross and red for a fail (black without `passed`). With `marks` ("up": fail -> pass,
    "down": pass -> fail, None: unchanged, per cell), a flipped picture gets a frame and a triangle (FLIP_MARKS)."""
    from PIL import Image, ImageDraw

    cells = [None if p is None else hwc(p) for p in pictures]
    first = next((p for p in cells if p is not None), None)
    if first is None:
        raise ValueError("no pictures")
    h, w = first.shape[0] * scale, first.shape[1] * scale
    font = caption_font()
    cap_h, pad = 40, 6
    rows = (len(cells) + columns - 1) // columns
    canvas = Image.new("RGB", (columns * (w + pad), rows * (h + cap_h + pad)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (pic, text) in enumerate(zip(cells, captions)):
        if pic is None:
            continue
        x, y = (i % columns) * (w + pad), (i // columns) * (h + cap_h + pad)
        canvas.paste(Image.fromarray(pic.astype(np.uint8)).resize((w, h), Image.NEAREST), (x, y))
        mark = FLIP_MARKS.get(marks[i]) if marks is not None and i < len(marks) else None
        if mark is not None:
            glyph, frame = mark
            draw.rectangle((x, y, x + w - 1, y + h - 1), outline=frame, width=3)
            draw.rectangle((x, y, x + 15, y + 15), fill=frame)
            draw.text((x + 2, y + 1), glyph, fill=(255, 255, 255), font=caption_font(12))
        if passed is None:
            colour = (0, 0, 0)
        else:
            colour = (0, 120, 0) if passed[i] else (190, 0, 0)
            text = ("\u2713 " if passed[i] else "\u2717 ") + text
        for k, ln in enumerate(wrap(text, font, w)[:3]):
            draw.text((x + 1, y + h + 1 + 12 * k), ln, fill=colour, font=font)
    return np.asarray(canvas)
