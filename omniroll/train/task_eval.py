"""The trainer's task evaluation (`trainer.evaluation`): GenEval on the shapes world's splits, drawn through the
rollout replicas with the validation sampling (the ODE) at the fixed seeds `omniroll eval` uses, so the table the
trainer logs for a step is the table `omniroll eval --checkpoint` prints for that step's checkpoint.

`run_task_eval` writes, per split, `eval/<tag>_<split>.json` and a captioned grid under the run directory (after
the last step also `eval/before_after_<split>.png`, the two grids one above the other), hands the flat metrics
(`eval/<split>/strict`, `eval/<split>/<category>/strict`, partial credit and the chance baseline alike) and the
console's summary lines (`eval_lines`) to the tracker, redraws `eval_curve.png` (strict accuracy per split and
category over the steps so far, from metrics.jsonl) and returns the metrics.
"""

from __future__ import annotations

import asyncio
import json
import os

from omniroll.agent_loop.batch import prompt_batch
from omniroll.evaluation.shapes import Evaluation, eval_uid, scored, write_evaluation
from omniroll.tasks.shapes.splits import prompts_of


def run_task_eval(manager, config, out_dir: str, tag: str, step: int, tracker) -> dict:
    """One evaluation of the replicas' current weights: written, logged (`Tracker.log_eval`: the console lines,
    metrics.jsonl, the trackers); returns its metrics."""
    ev_cfg = config.trainer.evaluation
    metrics: dict = {}
    results: dict[str, Evaluation] = {}
    for split in ev_cfg.splits:
        prompts = prompts_of(split)
        batch = prompt_batch(prompts, ev_cfg.seeds, lambda i: eval_uid(prompts[i]), data_source=f"eval/{split}",
                             meta_info={"validate": True})
        out = asyncio.run(manager.generate_sequences_async(batch))
        pictures = [p.permute(1, 2, 0).contiguous().numpy() for p in out.batch["responses"]]
        ev = scored(pictures, list(out.non_tensor_batch["raw_prompt"]), [int(s) for s in out.non_tensor_batch["seed"]])
        name = os.path.splitext(os.path.basename(split))[0]
        write_evaluation(ev, os.path.join(out_dir, "eval"), name=f"{tag}_{name}", title=f"{tag} (step {step}): {split}",
                         extra={"step": step, "tag": tag, "split": split, "seeds": ev_cfg.seeds})
        metrics.update(ev.report.flat(f"eval/{name}"))
        results[name] = ev
        if tag == "after":
            before_after_picture(os.path.join(out_dir, "eval"), name, step)
    tracker.log_eval(tag, step, metrics, eval_lines(tag, step, results))
    plot_eval_curve(out_dir)
    return metrics


def before_after_picture(eval_dir: str, name: str, step: int) -> None:
    """eval/before_after_<split>.png: the split's captioned grid before the first step above the one after the
    last (the same prompts and seeds, so each picture sits at the same place in both), each under a heading with
    its overall strict accuracy. Nothing when the run has no "before" evaluation (a resumed run)."""
    from PIL import Image, ImageDraw

    from omniroll.tasks.shapes.report import caption_font

    parts = []
    for tag, heading in (("before", "before training"), ("after", f"after {step} steps")):
        grid, record = (os.path.join(eval_dir, f"{tag}_{name}{ext}") for ext in ("_grid.png", ".json"))
        if not (os.path.isfile(grid) and os.path.isfile(record)):
            return
        with open(record) as f:
            strict = json.load(f)["overall"]["strict"]
        parts.append((Image.open(grid).convert("RGB"), f"{heading}: {100 * strict:.1f} % strict ({name})"))
    band = 28
    width = max(im.width for im, _ in parts)
    canvas = Image.new("RGB", (width, sum(im.height + band for im, _ in parts)), (255, 255, 255))
    draw, y = ImageDraw.Draw(canvas), 0
    for im, heading in parts:
        draw.text((4, y + 6), heading, fill=(0, 0, 0), font=caption_font(16))
        canvas.paste(im, (0, y + band))
        y += im.height + band
    canvas.save(os.path.join(eval_dir, f"before_after_{name}.png"))


def eval_lines(tag: str, step: int, results: dict[str, Evaluation]) -> list[str]:
    """One line per split: overall strict accuracy, the chance baseline and each category's accuracy (%)."""
    out = []
    for split, ev in results.items():
        r = ev.report
        cats = "  ".join(f"{t} {100 * c['strict']:.0f}" for t, c in r.categories.items())
        out.append(f"eval {tag} (step {step}) {split}: strict {100 * r.overall['strict']:.1f} % (chance "
                   f"{100 * r.overall['chance']:.1f} %, {r.overall['n']} pictures)  {cats}")
    return out


def plot_eval_curve(out_dir: str) -> None:
    """eval_curve.png: per split, the overall strict accuracy (thick), each category's (thin) and the chance
    baseline (dotted) at every evaluation in metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from omniroll.tasks.shapes.grammar import TAGS
    from omniroll.train.tracking import read_jsonl

    recs = [r for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl")) if "eval" in r]
    splits = sorted({k.split("/")[1] for r in recs for k in r if k.startswith("eval/")})
    if not recs or not splits:
        return
    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 4.0), dpi=100, squeeze=False)
    for ax, split in zip(axes[0], splits):
        rows = [r for r in recs if f"eval/{split}/strict" in r]
        steps = [r["step"] for r in rows]
        for i, tag in enumerate(TAGS):
            key = f"eval/{split}/{tag}/strict"
            if any(key in r for r in rows):
                ax.plot(steps, [100 * r.get(key, float("nan")) for r in rows], lw=1, marker=".", color=f"C{i}",
                        label=tag)
        ax.plot(steps, [100 * r[f"eval/{split}/strict"] for r in rows], lw=3, color="black", marker="o",
                label="overall")
        ax.plot(steps, [100 * r[f"eval/{split}/chance"] for r in rows], lw=1, ls=":", color="grey", label="chance")
        ax.set_title(f"{split}\nstrict accuracy (GenEval rules)", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("%")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "eval_curve.png"))
    plt.close(fig)
