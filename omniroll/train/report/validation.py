"""One validation of a training run: the fixed validation prompts x `val_kwargs.n` ODE samples at fixed seeds, scored
by the run's reward, in the regime the algorithm trains, and what it reports.

The regime (`validation_guidance`): the guidance the algorithm's rollout uses (`Algorithm.rollout_guidance`: CFG off
for NFT and AWM, which roll out and train the CFG-free policy; the pipeline's CFG for the others), unless
`val_kwargs.pipeline.guidance_scale` sets one. The trainer's evaluation follows the same rule
(`OmniRollConfig.evaluation_guidances`), so the grid, its curve and the paired verdict judge one model.

`run_validation` writes the captioned grid `val_<tag>.png` (`val_grid.py`), appends a record to `validation.jsonl`
(`val_reward_mean`, the weighted reward the trainer optimises, `cfg_scale`, and `reward/<fn>/mean` /
`reward/<fn>/<key>`: each reward function's own mean and each numeric scorer extra, `reward_breakdown.py`), hands the
batch to the trackers (`Tracker.log_validation`) and logs one line (with `reward.held_out`, `held_out.py` scores the
same pictures with the held-out functions and adds its lines, metrics and per-sample scores):

    validation after (CFG off): reward 0.1103 (colour 0.1103, strict 0.2500) -> out/val_after.png
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Optional

from omniroll.agent_loop.batch import prompt_batch
from omniroll.train.report.reward_breakdown import reward_breakdown, row_components
from omniroll.train.report.task_eval import guidance_label
from omniroll.train.report.tracking import append_jsonl
from omniroll.train.report.val_grid import caption_lines, save_val_grid


def breakdown_text(parts: dict[str, float]) -> str:
    """`colour 0.1103, strict 0.2500`: each function's mean by its name (the extras, a scorer's per-category values
    say, go to validation.jsonl and the trackers: on the console they would drown the line)."""
    return ", ".join(f"{k.removesuffix('/mean')} {v:.4f}" for k, v in parts.items() if k.endswith("/mean"))


def validation_guidance(config: Any, algorithm: Any) -> tuple[dict, float]:
    """(the sampling fields the validation lays over `val_kwargs`'s, its classifier-free guidance scale): the
    algorithm's rollout guidance, less a scale `val_kwargs.pipeline` sets (module doc)."""
    explicit = config.val_kwargs.pipeline.model_dump(exclude_none=True)
    over = {k: v for k, v in algorithm.rollout_guidance().items() if k not in explicit}
    sampling = {**config.sampling_params(validate=True), **over}
    distilled = algorithm.adapter.guidance_kind == "distilled"
    return over, float(sampling["true_cfg_scale" if distilled else "guidance_scale"])


def run_validation(manager: Any, prompts: list[str], n: int, out_dir: str, tag: str, step: int, tracker: Any,
                   log: Callable[[str], None], sampling: Optional[dict] = None,
                   cfg_scale: Optional[float] = None, held_out: Any = None) -> dict:
    """Generate, score and report one validation (module doc) with `sampling` over `val_kwargs`'s sampling
    (`validation_guidance`); with `held_out` (a `HeldOutRewards`), its functions scored on the same pictures; returns
    its validation.jsonl record."""
    meta = {"validate": True, **({"sampling_params": dict(sampling)} if sampling else {})}
    batch = prompt_batch(prompts, n, lambda i: f"val{i:04d}", data_source="val", meta_info=meta)
    out = asyncio.run(manager.generate_sequences_async(batch))
    path = os.path.join(out_dir, f"val_{tag}.png")
    scored = "rm_scores" in out.batch.keys()
    rewards = out.batch["rm_scores"][:, 0].tolist() if scored else [None] * len(out)
    texts = list(out.non_tensor_batch.get("raw_prompt", [p for p in prompts for _ in range(n)]))
    save_val_grid(out.batch["responses"], len(prompts), n, path,
                  captions=[caption_lines(str(texts[i]), rewards[i], row_components(out, i)) for i in range(len(out))])
    score = float(out.batch["rm_scores"].mean()) if scored else None
    parts = reward_breakdown(out)
    rec = {"tag": tag, "step": step, "val_reward_mean": score, **{f"reward/{k}": v for k, v in parts.items()},
           "grid": path, **({"cfg_scale": cfg_scale} if cfg_scale is not None else {})}
    tracker.log_validation(tag, step, out, score, path)
    detail = f" ({breakdown_text(parts)})" if parts else ""
    label = f"validation {tag}" + (f" ({guidance_label(cfg_scale)})" if cfg_scale is not None else "")
    log(f"{label}: reward {score:.4f}{detail} -> {path}" if score is not None else label)
    if held_out is not None:  # reward.held_out: scored on these pictures only (held_out.py)
        rec.update(held_out.observe(out, tag, step, tracker, log))
    append_jsonl(os.path.join(out_dir, "validation.jsonl"), rec)
    return rec
