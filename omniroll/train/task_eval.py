"""The trainer's task evaluation (`trainer.evaluation`): GenEval on the shapes world's splits, drawn through the
rollout replicas with the validation sampling (the ODE) at the fixed seeds `omniroll eval` uses, so the table the
trainer logs for a step is the table `omniroll eval --checkpoint` prints for that step's checkpoint.

`run_task_eval` returns the flat metrics (`eval/<split>/strict`, `eval/<split>/<category>/strict`, partial credit
and the chance baseline alike) and writes, per split, `eval/<tag>_<split>.json` and a captioned grid under the run
directory; `eval_lines` is the console's summary of one evaluation.
"""

from __future__ import annotations

import asyncio
import os

from omniroll.agent_loop.batch import prompt_batch
from omniroll.evaluation.shapes import Evaluation, eval_uid, scored, write_evaluation
from omniroll.tasks.shapes.splits import prompts_of


def run_task_eval(manager, config, out_dir: str, tag: str, step: int) -> tuple[dict, dict[str, Evaluation]]:
    """(metrics, {split: Evaluation}) of one evaluation of the replicas' current weights."""
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
    return metrics, results


def eval_lines(tag: str, step: int, results: dict[str, Evaluation]) -> list[str]:
    """One line per split: overall strict accuracy, the chance baseline and each category's accuracy (%)."""
    out = []
    for split, ev in results.items():
        r = ev.report
        cats = "  ".join(f"{t} {100 * c['strict']:.0f}" for t, c in r.categories.items())
        out.append(f"eval {tag} (step {step}) {split}: strict {100 * r.overall['strict']:.1f} % (chance "
                   f"{100 * r.overall['chance']:.1f} %, {r.overall['n']} pictures)  {cats}")
    return out
