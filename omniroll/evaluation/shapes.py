"""GenEval on the shapes worlds: generate every prompt at fixed seeds with the deterministic ODE, score each picture
(or each clip of the moving-shapes world) with the exact checker, and tabulate strict accuracy per category against a
chance baseline (`omniroll.tasks.shapes.report`).

`evaluate(engine, prompts, seeds, sampling, task=...)` runs it on an in-process `DiffusionEngine` (`omniroll eval`,
`omniroll pretrain shapes`); the trainer validates with the same prompts, seeds and scoring through its replicas.
The task (`omniroll.evaluation.worlds`: "shapes" or "moving_shapes") says which prompts and checker; a clip is shown
as its film strip, and the moving-shapes world adds the frame baselines (`omniroll.evaluation.baselines`).
`write_evaluation` writes `eval.json` (the table, every picture's prompt, seed and result) and a captioned grid
(flipped pictures marked when a paired comparison is given: `omniroll.evaluation.paired`); `flips_picture` draws the
pictures a change flipped, the baseline's above the new ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from omniroll.evaluation.worlds import EvalWorld, world_for
from omniroll.tasks.shapes.report import Report, Scored, captioned_grid

__all__ = ["Evaluation", "eval_sampling", "eval_seed", "eval_uid", "evaluate", "flips_picture", "prompts_of",
           "sample_array", "scored", "write_evaluation"]
from omniroll.tasks.shapes.splits import prompts_of


@dataclass
class Evaluation:
    prompts: list[str]  # one per picture
    seeds: list[int]
    pictures: list[np.ndarray]  # uint8 [H, W, 3], or clips [T, H, W, 3]
    rows: list[Scored]
    report: Report
    task: str = "shapes"  # the world (`omniroll.evaluation.worlds`)

    @property
    def world(self) -> EvalWorld:
        return world_for(self.task)

    def baselines(self) -> dict:
        """The frame baselines of a clip evaluation (`omniroll.evaluation.baselines`); {} for pictures."""
        from omniroll.evaluation.baselines import baseline_report

        return baseline_report(self.rows, self.world.tags) if self.world.clips else {}

    def to_dict(self) -> dict:
        baselines = self.baselines()
        return {"task": self.task, **self.report.to_dict(), **({"baselines": baselines} if baselines else {}),
                "pictures": self.picture_records()}

    def picture_records(self) -> list[dict]:
        """Every picture's prompt, seed, category, verdicts and reasons (what a paired comparison reads), and whether
        it shows extra objects where the checker says so."""
        return [{"prompt": r.prompt, "seed": s, "tag": r.tag, "strict": r.strict, "partial": r.partial,
                 "chance": r.chance, "reasons": list(r.reasons), **({} if r.extra is None else {"extra": r.extra})}
                for r, s in zip(self.rows, self.seeds)]


def eval_sampling(config) -> dict:
    """The evaluation's sampling: the config's validation sampling (`val_kwargs` over `pipeline`; the ODE, no
    log-probs), which is what the trainer's validation uses."""
    return config.sampling_params(validate=True)


def eval_uid(prompt: str) -> str:
    """The prompt group an evaluation picture belongs to: the prompt itself, so its seeds do not depend on where the
    prompt sits in a list."""
    return f"eval|{prompt}"


def eval_seed(base: int, prompt: str, index: int) -> int:
    """The seed of a prompt's index-th evaluation picture: the agent loop's validation seed of that row
    (`derive_seed(val_kwargs.seed, 0, eval_uid(prompt), index)`), so `omniroll eval` on a checkpoint draws exactly
    the pictures the trainer's evaluation drew with those weights."""
    from omniroll.sampling.seeds import derive_seed

    return derive_seed(base, 0, eval_uid(prompt), index)


def evaluate(engine, prompts: list[str], seeds: int, sampling: dict, base_seed: int,
             progress: bool = False, task: str = "shapes") -> Evaluation:
    """Every prompt `seeds` times (seeds `eval_seed(base_seed, prompt, 0 .. seeds - 1)`) on `engine` (a
    `DiffusionEngine`), scored in `task`'s world and tabulated."""
    from omniroll import GenerationRequest, SamplingParams

    sp = SamplingParams(**{**sampling, "logprobs": False})
    reqs = [GenerationRequest(request_id=f"eval-{i}-{j}", prompt=p, seed=eval_seed(base_seed, p, j), sampling_params=sp)
            for i, p in enumerate(prompts) for j in range(seeds)]
    outs = engine.generate(reqs, progress=progress)
    pictures = [sample_array(o.diffusion_output) for o in outs]
    return scored(pictures, [r.prompt for r in reqs], [r.seed for r in reqs], task)


def sample_array(output) -> np.ndarray:
    """An engine's sample as the checkers read it: a picture [3, H, W] -> [H, W, 3], a clip [T, 3, H, W] ->
    [T, H, W, 3] (uint8, contiguous)."""
    order = (0, 2, 3, 1) if output.ndim == 4 else (1, 2, 0)
    return output.permute(*order).contiguous().numpy()


def scored(pictures: list[np.ndarray], prompts: list[str], seeds: list[int], task: str = "shapes") -> Evaluation:
    """The samples scored in `task`'s world and tabulated."""
    world = world_for(task)
    rows = world.score(prompts, pictures, seeds)
    return Evaluation(prompts, seeds, pictures, rows, Report.from_rows(rows, world.tags, world.extra_label), task)


def write_evaluation(ev: Evaluation, out_dir: str, name: str = "eval", title: str = "",
                     grid_per_category: Optional[int] = None, extra: Optional[dict] = None,
                     flipped: Optional[dict] = None) -> dict:
    """`{name}.json` and `{name}_grid.png` (a row per category: its first `grid_per_category` pictures, default the
    world's: 8 pictures, 4 clips as film strips; each captioned with the prompt, a check mark and green for a pass,
    a cross and red for a fail, and a failed clip's first reason) under `out_dir`; `flipped`
    ({(prompt, seed): "up" | "down"}, `omniroll.evaluation.paired.flips`) frames the pictures that flipped against
    a baseline. Returns {json, grid} paths."""
    from PIL import Image

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump({"title": title, **(extra or {}), **ev.to_dict()}, f, indent=1)
        f.write("\n")
    world = ev.world
    grid_per_category = grid_per_category or world.grid_per_category
    cells, caps, passed, marks = [], [], [], []
    for tag in ev.report.categories:  # one row per category
        mine = [i for i, r in enumerate(ev.rows) if r.tag == tag][:grid_per_category]
        pad = grid_per_category - len(mine)
        cells += [world.cell(ev.pictures[i]) for i in mine] + [None] * pad
        caps += [world.caption(ev.rows[i]) for i in mine] + [""] * pad
        passed += [ev.rows[i].strict for i in mine] + [False] * pad
        marks += [(flipped or {}).get((ev.rows[i].prompt, ev.seeds[i])) for i in mine] + [None] * pad
    grid = captioned_grid(cells, caps, passed, columns=grid_per_category, marks=marks, scale=world.scale)
    grid_path = os.path.join(out_dir, f"{name}_grid.png")
    Image.fromarray(grid).save(grid_path)
    return {"json": json_path, "grid": grid_path}


def flips_picture(base: Evaluation, new: Evaluation, flipped: dict, path: str, title: str = "",
                  columns: Optional[int] = None, labels: tuple[str, str] = ("before", "after")) -> Optional[str]:
    """A PNG of the pictures that flipped: for "fail -> pass" and then "pass -> fail", up to `columns` of them
    (default the world's: 12 pictures, 4 clips as film strips; taken evenly over the categories), the baseline's
    picture above the new one at the same prompt and seed, captioned with `labels` (baseline's, new one's), each
    section under a heading with its count. None (nothing written) when no picture flipped."""
    from PIL import Image, ImageDraw

    from omniroll.tasks.shapes.report import caption_font

    if not flipped:
        return None
    world = new.world
    columns = columns or world.flip_columns
    at = {(r.prompt, s): i for i, (r, s) in enumerate(zip(base.rows, base.seeds))}
    at_new = {(r.prompt, s): i for i, (r, s) in enumerate(zip(new.rows, new.seeds))}
    parts = []
    for kind, heading in (("up", "fail -> pass"), ("down", "pass -> fail")):
        keys = [(r.prompt, s) for r, s in zip(new.rows, new.seeds) if flipped.get((r.prompt, s)) == kind]
        if not keys:
            continue
        by_tag: dict[str, list] = {}
        for k in keys:
            by_tag.setdefault(new.rows[at_new[k]].tag, []).append(k)
        shown = round_robin(list(by_tag.values()), columns)
        pad = [None] * (columns - len(shown))
        cells = [world.cell(base.pictures[at[k]]) for k in shown] + pad
        cells += [world.cell(new.pictures[at_new[k]]) for k in shown] + pad
        caps = [world.caption(base.rows[at[k]], labels[0]) for k in shown] + [""] * len(pad)
        caps += [world.caption(new.rows[at_new[k]], labels[1]) for k in shown] + [""] * len(pad)
        passed = [kind == "down"] * columns + [kind == "up"] * columns
        marks = [None] * columns + [kind] * columns
        grid = captioned_grid(cells, caps, passed, columns=columns, marks=marks, scale=world.scale)
        parts.append((Image.fromarray(grid), f"{heading}: {len(keys)} picture(s)"
                      + (f", {len(shown)} shown" if len(shown) < len(keys) else "")))
    band = 28
    width = max(im.width for im, _ in parts)
    canvas = Image.new("RGB", (width, band + sum(im.height + band for im, _ in parts)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 6), title, fill=(0, 0, 0), font=caption_font(16))
    y = band
    for im, heading in parts:
        draw.text((4, y + 6), heading, fill=(0, 0, 0), font=caption_font(14))
        canvas.paste(im, (0, y + band))
        y += im.height + band
    canvas.save(path)
    return path


def round_robin(groups: list[list], limit: int) -> list:
    """Up to `limit` items taken one from each group in turn (the categories evenly)."""
    out: list = []
    k = 0
    while len(out) < limit and any(k < len(g) for g in groups):
        out += [g[k] for g in groups if k < len(g)][: limit - len(out)]
        k += 1
    return out
