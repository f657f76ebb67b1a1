"""`run_rollout`: one rollout batch end to end on Ray from Python (what `omniroll rollout` runs), and the files it
writes (`write_rollout_outputs`).

The cluster joins Ray at `RAY_ADDRESS` (else a local one; see `omniroll.agent_loop.cluster.RolloutCluster`). Prompt
groups are submitted as separate agent-loop calls, all at once, so a group that finished is kept when another fails
or the run is interrupted. Files, when `out_dir` is given: `images/{row:04d}_{uid}_{index}.png` (video: `.mp4`, or
`.webp` without an H.264 encoder, plus `_frames.png`), `trajectories.safetensors` (the layout of
`omniroll.trajectory_file`, as `omniroll generate` writes it), `rewards.jsonl` (one line per row: request_id, uid,
seed, status, score, components, error) and `metrics.json` (per-sample metrics, timing summary, weight versions, run:
model, device, dtype, batch invariance, seeds, package versions).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional


async def run_rollout(config: Any, prompts: list[str], n: int, out_dir: Optional[str] = None,
                      progress: bool = True, validate: bool = False):
    """Generate (and score) `n` samples per prompt with the config's replicas and reward workers; a DataBatch.
    Finished prompt groups are written to `out_dir` even when others fail (then `AgentLoopError` lists every failed
    row, global row numbers, and carries the finished ones: `error.batch`) or the run is interrupted
    (KeyboardInterrupt / cancellation, re-raised after writing)."""
    import asyncio

    from omniroll.agent_loop.batch import command_batch
    from omniroll.agent_loop.cluster import RolloutCluster
    from omniroll.agent_loop.worker import AgentLoopError
    from omniroll.config import OmniRollConfig, load_config

    cfg = config if isinstance(config, OmniRollConfig) else load_config(config)
    batch = command_batch(prompts, n, rollout_seed=cfg.seed, validate=validate)
    say = (lambda msg: print(f"[omniroll] {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    t0 = time.perf_counter()
    cluster = RolloutCluster(cfg, log=say)  # resolves the model; Ray, replicas, rewards, manager in start()
    groups = batch.split([n] * len(prompts))
    tasks: list = []
    try:
        cluster.start()
        say(f"generating {len(batch)} samples ({len(prompts)} prompts x {n})")
        tasks = [asyncio.ensure_future(cluster.manager.generate_sequences_async(group)) for group in groups]
        await asyncio.gather(*tasks, return_exceptions=True)
        say(f"done in {time.perf_counter() - t0:.1f}s")
    finally:
        parts, kept_rows, failed_rows, interrupted = _collect(tasks, groups, n)
        cluster.close()
        out = _merge(parts, time.perf_counter() - t0) if parts else None
        if out_dir and out is not None:
            write_rollout_outputs(out, out_dir, run_info_for(cfg, cluster.model), fps=cfg.pipeline.fps)
            say(f"wrote {len(out)} of {len(batch)} samples to {out_dir}")
    if failed_rows:
        raise AgentLoopError.from_rows(failed_rows, len(batch), batch=out, succeeded_rows=kept_rows)
    if interrupted:
        raise KeyboardInterrupt
    return out


def _collect(tasks: list, groups: list, n: int) -> tuple[list, list[int], list[dict], bool]:
    """(finished group batches, their global row numbers, failed rows as `AgentLoopError.failed_rows` entries with
    global row numbers, whether some group was cancelled / unfinished). A group that failed as a whole (not row by
    row) fails each of its rows with the group's error."""
    from omniroll.agent_loop.worker import AgentLoopError

    parts, kept, failed, interrupted = [], [], [], False
    for g, t in enumerate(tasks):
        if not t.done() or t.cancelled():
            interrupted = True
            if not t.done():
                t.cancel()
            continue
        e = t.exception()
        if e is None:
            parts.append(t.result())
            kept += range(g * n, g * n + n)
        elif isinstance(e, AgentLoopError):
            if e.batch is not None and len(e.batch):
                parts.append(e.batch)  # the group's rows that succeeded are kept
                kept += [g * n + r for r in e.succeeded_rows]
            failed += [{**f, "row": g * n + int(f.get("row", 0))} for f in e.failed_rows]
        else:
            text = str(e).strip().splitlines()
            why = f"prompt {g} failed: {type(e).__name__}: {text[-1] if text else ''}"
            failed += [{"row": g * n + j, "uid": uid, "request_id": None, "error": why}
                       for j, uid in enumerate(groups[g].non_tensor_batch["uid"])]
    return parts, kept, failed, interrupted


def _merge(parts: list, wall: float):
    from omniroll.agent_loop.manager import batch_timing, merge

    for p in parts:
        p.meta_info.pop("timing", None)
    out = merge(parts)
    out.meta_info["timing"] = batch_timing(out.meta_info.get("metrics", []), wall)
    return out


def run_info_for(cfg, model: str) -> dict:
    """The `run` record of a rollout's files (model, device, dtype, batch invariance, seed, threads, replicas)."""
    from omniroll.files import run_info

    return run_info("rollout", model, cfg.engine.device, cfg.engine.dtype,
                    bool(cfg.engine.kwargs.get("batch_invariant", str(cfg.engine.device).startswith("cpu"))), cfg.seed,
                    num_threads=cfg.engine.num_threads, replicas=cfg.replicas.count)


def write_rollout_outputs(out, out_dir: str, run: Optional[dict] = None, fps: int = 16) -> list[str]:
    """Write a rollout batch into `out_dir` (files 0644; the module doc lists them); returns the paths written."""
    import io

    import torch
    from PIL import Image

    from omniroll.files import jsonable, write_bytes, write_json, write_text
    from omniroll.trajectory_file import FILE_NAME, write_trajectories

    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    nt = out.non_tensor_batch
    files = []
    if "responses" in out.batch.keys() and out.batch["responses"].dtype == torch.uint8:
        for i, img in enumerate(out.batch["responses"]):
            if nt["status"][i] == "failed":
                continue
            name = f"{i:04d}_{_safe(nt['uid'][i])}_{nt['_group_index'][i]}.png"
            if img.ndim == 4:  # video: .mp4 (or .webp) + a PNG strip of its frames
                from omniroll.media import save_sample

                stem = Path(out_dir) / "images" / name[:-4]
                files += [str(f) for f in save_sample(img, stem, fps=fps)]
                continue
            buf = io.BytesIO()
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
            files.append(write_bytes(os.path.join(out_dir, "images", name), buf.getvalue()))
    files.append(write_trajectories(out, os.path.join(out_dir, FILE_NAME), run or {}))
    infos = nt.get("reward_extra_info", [None] * len(out))
    scores = out.batch["rm_scores"][:, 0].tolist() if "rm_scores" in out.batch.keys() else [None] * len(out)
    lines = []
    errors = nt.get("error", [None] * len(out))
    for i in range(len(out)):
        info = infos[i] or {}
        lines.append(json.dumps(jsonable({
            "row": i, "request_id": nt["request_id"][i], "uid": nt["uid"][i], "seed": nt["seed"][i],
            "status": nt["status"][i], "score": scores[i] if scores[i] is not None else info.get("score"),
            "components": info.get("components"), "error": errors[i] or info.get("error"),
        })))
    files.append(write_text(os.path.join(out_dir, "rewards.jsonl"), "".join(line + "\n" for line in lines)))
    meta = {k: out.meta_info.get(k) for k in ("metrics", "timing", "min_weight_version", "max_weight_version",
                                             "reward_extra_keys", "global_steps")}
    meta["run"] = run or {}
    files.append(write_json(os.path.join(out_dir, "metrics.json"), meta))
    return files


def _safe(s: Any) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in str(s))[:64]
