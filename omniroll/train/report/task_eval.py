"""The trainer's task evaluation (`trainer.evaluation`): GenEval on the task world's splits (`trainer.evaluation.task`:
the shapes world's pictures, or the moving-shapes world's clips: `omniroll.evaluation.worlds`) at each guidance scale,
drawn through the rollout replicas with the validation sampling (the ODE) at the fixed seeds `omniroll eval` uses,
and every evaluation after the first compared, picture by picture, with the one before training.

`TaskEvaluation.run(manager, tracker, tag, step)` evaluates the weights the replicas hold: for every guidance scale G of
`config.evaluation_guidances()` (the regime the algorithm trains first: CFG off for NFT and AWM) and every split, the
evaluation `<split>_cfg<G>` (e.g. `shapes_eval_train_cfg1`), at `seeds` pictures per prompt (`beside_seeds` at the
scales after the first). It writes `eval/<tag>_<name>.json` and a captioned grid
under the run directory, hands the flat metrics (`eval/<name>/strict`, its standard error `eval/<name>/se`,
`eval/<name>/<category>/strict`, partial credit and the chance baseline alike) and the console lines to the tracker,
and redraws `eval_curve.png`. Every evaluation after "before" is paired with it (`omniroll.evaluation.paired`: the
same prompts and seeds): `eval/<name>/paired_up`, `paired_down`, `paired_z` (overall and per category) and a verdict
line, and where the checker counts extra objects their pairing (`extra_gained`, `extra_lost`, `extra_paired_z`) and
the verdict of strict with no extra object (`clean_paired_up`, `_down`, `_z`) in a second line; its grid frames the
flipped pictures; after the last step `eval/before_after_<name>.png` (the two grids, one above the other) and
`eval/flips_<name>.png` (the flipped pictures, before above after). In a CFG-free regime the
model CFG off is also paired with the guided model before training (`eval/<name>/vs_guided_before_z`: whether
training made guidance unnecessary). A resumed run reads the
"before" verdicts from `eval/before_<name>.json` (the paired numbers; its pictures, and so the two PNGs, only exist
in the process that drew them). The evaluation before training is read from the evaluation cache
(`omniroll.evaluation.cache`, `trainer.evaluation.cache`) when a run with the same weights, sampling and seeds drew
it before and the pictures (or clips) drawn again to check it match bitwise or in their verdicts; every file is
then what drawing it would write.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Optional

from omniroll.agent_loop.batch import prompt_batch
from omniroll.evaluation.cache import EvaluationCache, eligible, evaluate_kept
from omniroll.evaluation.paired import (common_pictures, extra_objects, extra_objects_line, flips, paired,
                                       verdict_line)
from omniroll.evaluation.shapes import (Evaluation, eval_sampling, eval_uid, flips_picture, sample_array, scored,
                                        write_evaluation)
from omniroll.evaluation.worlds import world_for


def evaluation_name(split: str, guidance: float) -> str:
    """`<split file's stem>_cfg<G>`: every evaluation's name says its guidance scale."""
    return f"{os.path.splitext(os.path.basename(split))[0]}_cfg{guidance:g}"


def guidance_label(guidance: float) -> str:
    return "CFG off" if guidance <= 1.0 else f"CFG {guidance:g}"


class TaskEvaluation:
    """The evaluations of one run (module doc); keeps the "before" ones to pair every later one with."""

    def __init__(self, config, out_dir: str):
        self.config = config
        self.eval_dir = os.path.join(out_dir, "eval")
        self.out_dir = out_dir
        self.before: dict[str, Evaluation] = {}

    def run(self, manager, tracker, tag: str, step: int, replicas: list = ()) -> dict:
        """One evaluation of the weights `manager`'s replicas hold: written, paired, logged (`tracker.log_eval`);
        returns its metrics. The one before training is read from the evaluation cache when `replicas` (their Ray
        handles) drew it before (`draw_kept`)."""
        ev_cfg = self.config.trainer.evaluation
        metrics: dict = {}
        lines: list[str] = []
        identity = self.kept_identity(replicas) if tag == "before" else None
        prompts_of = world_for(ev_cfg.task).prompts_of
        for k, guidance in enumerate(self.config.evaluation_guidances()):
            seeds = ev_cfg.seeds if k == 0 or ev_cfg.beside_seeds is None else ev_cfg.beside_seeds
            for split in ev_cfg.splits:
                name = evaluation_name(split, guidance)
                kept: dict = {}
                if identity is None:
                    ev = self.draw(manager, prompts_of(split), seeds, guidance, split)
                else:
                    ev, kept = self.draw_kept(manager, identity, prompts_of(split), seeds, guidance, split)
                base = self.baseline(name, ev) if tag != "before" else None
                records = ev.picture_records()
                flipped = flips(base, records) if base is not None else None
                write_evaluation(ev, self.eval_dir, name=f"{tag}_{name}", flipped=flipped,
                                 title=f"{tag} (step {step}): {split}, {guidance_label(guidance)}",
                                 extra={"step": step, "tag": tag, "split": split, "seeds": seeds,
                                        "guidance_scale": guidance, **({"cache": kept} if kept else {})})
                metrics.update(ev.report.flat(f"eval/{name}"))
                lines.append(summary_line(tag, step, name, guidance, ev))
                if kept:
                    lines.append(f"  {kept['note']}")
                if base is not None:
                    cmp = paired(base, records)
                    metrics.update(paired_metrics(f"eval/{name}", cmp))
                    lines.append(f"  vs before: {verdict_line(cmp['overall'], ev.world.noun)}")
                    extra = extra_objects(base, records)
                    if extra is not None:
                        metrics.update(extra_metrics(f"eval/{name}", extra))
                        lines.append(f"  {extra_objects_line(extra, ev.world.noun)}")
                if tag == "before":
                    self.before[name] = ev
                elif tag == "after" and name in self.before:
                    before_after_picture(self.eval_dir, name, step)
                    flips_picture(self.before[name], ev, flipped, os.path.join(self.eval_dir, f"flips_{name}.png"),
                                  title=f"{name}: the pictures {step} steps flipped (same prompts and seeds)")
        if tag != "before":
            lines += self.across_guidance(tag, metrics)
        tracker.log_eval(tag, step, metrics, lines)
        plot_eval_curve(self.out_dir)
        return metrics

    def across_guidance(self, tag: str, metrics: dict) -> list[str]:
        """A CFG-free regime (first scale <= 1, a guided one after): the model now, CFG off, paired with the one before
        training at the largest scale, at the pictures both drew (`eval/<name>/vs_guided_before_z`, ...): whether
        training made guidance unnecessary."""
        scales = self.config.evaluation_guidances()
        if not (scales[0] <= 1.0 < max(scales)):
            return []
        lines = []
        for split in self.config.trainer.evaluation.splits:
            off, guided = evaluation_name(split, scales[0]), evaluation_name(split, max(scales))
            now, base = (os.path.join(self.eval_dir, f) for f in (f"{tag}_{off}.json",
                                                                  f"before_{guided}.json"))
            if not (os.path.isfile(now) and os.path.isfile(base)):
                continue
            with open(base) as b, open(now) as n:
                before, after = common_pictures(json.load(b)["pictures"], json.load(n)["pictures"])
            o = paired(before, after)["overall"]
            metrics.update({f"eval/{off}/vs_guided_before_{k}": float(o[k]) for k in ("up", "down", "z")})
            noun = world_for(self.config.trainer.evaluation.task).noun
            lines.append(f"{off} (CFG off) vs {guided} before training (CFG {max(scales):g}), {o['n']} {noun}s: "
                         f"{verdict_line(o, noun)}")
        return lines

    def draw(self, manager, prompts: list[str], seeds: int, guidance: float, split: str,
             indices: Optional[list[int]] = None) -> Evaluation:
        """Every prompt (those at `indices`, default all) `seeds` times through the replicas, with the validation
        sampling at `guidance`."""
        batch = prompt_batch(prompts, seeds, lambda i: eval_uid(prompts[i]), data_source=f"eval/{split}",
                             indices=indices,
                             meta_info={"validate": True, "sampling_params": {"guidance_scale": guidance}})
        out = asyncio.run(manager.generate_sequences_async(batch))
        pictures = [sample_array(p) for p in out.batch["responses"]]
        return scored(pictures, list(out.non_tensor_batch["raw_prompt"]),
                      [int(s) for s in out.non_tensor_batch["seed"]], self.config.trainer.evaluation.task)

    def kept_identity(self, replicas: list) -> Optional[dict]:
        """The replicas' common `sample_identity` when `trainer.evaluation.cache` is on and they draw
        batch-invariantly (`omniroll.evaluation.cache.eligible`); else None: the evaluation is drawn (also when a
        replica cannot say within 2 minutes: a dead one's samples are drawn by the others, as without the cache)."""
        ev_cfg = self.config.trainer.evaluation
        if not ev_cfg.cache or not replicas:
            return None
        import ray

        try:
            return eligible(ray.get([r.sample_identity.remote() for r in replicas], timeout=120))
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def draw_kept(self, manager, identity: dict, prompts: list[str], seeds: int, guidance: float,
                  split: str) -> tuple[Evaluation, dict]:
        """`omniroll.evaluation.cache.evaluate_kept` through the replicas: read from the cache after the check, else
        drawn whole and kept. Returns the evaluation and `{"key", "read", "checked", "agreed", "note"}`. The model's
        directory may ship entries (`EvaluationCache.for_model`)."""
        from omniroll.models import resolve_model

        cache = EvaluationCache.for_model(resolve_model(self.config.engine.model))
        sampling = {**eval_sampling(self.config), "guidance_scale": float(guidance)}
        return evaluate_kept(cache, identity, sampling, prompts, seeds, self.config.val_kwargs.seed,
                             lambda indices, n: self.draw(manager, prompts, n, guidance, split, indices=indices))

    def baseline(self, name: str, ev: Evaluation) -> Optional[list[dict]]:
        """The "before" pictures' verdicts of evaluation `name`: this process's, else `eval/before_<name>.json` (a
        resumed run); None when there is none or it holds other pictures (the config changed in between)."""
        if name in self.before:
            return self.before[name].picture_records()
        path = os.path.join(self.eval_dir, f"before_{name}.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            pictures = json.load(f).get("pictures", [])
        have = {(p["prompt"], int(p["seed"])) for p in pictures}
        return pictures if have == set(zip((r.prompt for r in ev.rows), ev.seeds)) else None


def paired_metrics(prefix: str, cmp: dict) -> dict[str, float]:
    """`{prefix}/paired_up`, `paired_down`, `paired_z`, and `{prefix}/<category>/paired_*`."""
    out = {f"{prefix}/paired_{k}": float(cmp["overall"][k]) for k in ("up", "down", "z")}
    for tag, c in cmp["categories"].items():
        out.update({f"{prefix}/{tag}/paired_{k}": float(c[k]) for k in ("up", "down", "z")})
    return out


def extra_metrics(prefix: str, extra: dict) -> dict[str, float]:
    """`{prefix}/extra_gained`, `extra_lost`, `extra_paired_z` and `{prefix}/clean_paired_{up,down,z}` (strict with no
    extra object, paired with before)."""
    out = {f"{prefix}/extra_{k}": float(extra[k]) for k in ("gained", "lost")}
    out[f"{prefix}/extra_paired_z"] = float(extra["z"])
    out.update({f"{prefix}/clean_paired_{k}": float(extra["clean"][k]) for k in ("up", "down", "z")})
    return out


def summary_line(tag: str, step: int, name: str, guidance: float, ev: Evaluation) -> str:
    """Overall strict accuracy +- its standard error, the chance baseline and each category's accuracy (%)."""
    r = ev.report
    cats = "  ".join(f"{t} {100 * c['strict']:.0f}" for t, c in r.categories.items())
    return (f"eval {tag} (step {step}) {name} ({guidance_label(guidance)}): strict {100 * r.overall['strict']:.1f} "
            f"+- {100 * r.overall['se']:.1f} % (chance {100 * r.overall['chance']:.1f} %, {r.overall['n']} "
            f"{ev.world.noun}s)"
            f"  {cats}")


def before_after_picture(eval_dir: str, name: str, step: int) -> None:
    """eval/before_after_<name>.png: the evaluation's captioned grid before the first step above the one after the
    last (the same prompts and seeds, so each picture sits at the same place in both; the flipped ones framed in the
    second), each under a heading with its overall strict accuracy."""
    from PIL import Image, ImageDraw

    from omniroll.tasks.shapes.report import caption_font

    parts = []
    for tag, heading in (("before", "before training"), ("after", f"after {step} steps")):
        grid, record = (os.path.join(eval_dir, f"{tag}_{name}{ext}") for ext in ("_grid.png", ".json"))
        if not (os.path.isfile(grid) and os.path.isfile(record)):
            return
        with open(record) as f:
            o = json.load(f)["overall"]
        parts.append((Image.open(grid).convert("RGB"),
                      f"{heading}: {100 * o['strict']:.1f} +- {100 * o['se']:.1f} % strict ({name})"))
    band = 28
    width = max(im.width for im, _ in parts)
    canvas = Image.new("RGB", (width, sum(im.height + band for im, _ in parts)), (255, 255, 255))
    draw, y = ImageDraw.Draw(canvas), 0
    for im, heading in parts:
        draw.text((4, y + 6), heading, fill=(0, 0, 0), font=caption_font(16))
        canvas.paste(im, (0, y + band))
        y += im.height + band
    canvas.save(os.path.join(eval_dir, f"before_after_{name}.png"))


def plot_eval_curve(out_dir: str) -> None:
    """eval_curve.png: per evaluation (split and guidance), the overall strict accuracy (thick, with its standard
    error), each category's (thin) and the chance baseline (dotted) at every evaluation in metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from omniroll.tasks.shapes.grammar import TAGS
    from omniroll.train.report.tracking import read_jsonl

    recs = [r for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl")) if "eval" in r]
    names = sorted({k.split("/")[1] for r in recs for k in r if k.startswith("eval/")})
    if not recs or not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.0), dpi=100, squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in recs if f"eval/{name}/strict" in r]
        steps = [r["step"] for r in rows]
        for i, tag in enumerate(TAGS):
            key = f"eval/{name}/{tag}/strict"
            if any(key in r for r in rows):
                ax.plot(steps, [100 * r.get(key, float("nan")) for r in rows], lw=1, marker=".", color=f"C{i}",
                        label=tag)
        ax.errorbar(steps, [100 * r[f"eval/{name}/strict"] for r in rows],
                    yerr=[100 * r.get(f"eval/{name}/se", 0.0) for r in rows], lw=3, color="black", marker="o",
                    capsize=4, label="overall (+- se)")
        ax.plot(steps, [100 * r[f"eval/{name}/chance"] for r in rows], lw=1, ls=":", color="grey", label="chance")
        ax.set_title(f"{name}\nstrict accuracy (GenEval rules)", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("%")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "eval_curve.png"))
    plt.close(fig)
