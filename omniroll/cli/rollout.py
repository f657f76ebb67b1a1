"""`omniroll rollout`: one rollout batch end to end (replicas, reward workers, agent-loop manager) on local Ray.

`run_rollout` is the same thing from Python.

Writes, when `out_dir` is given: `images/{row:04d}_{uid}_{index}.png` (video: `.mp4`, or `.webp` without an H.264
encoder, plus `_frames.png`), `trajectories.safetensors` (every tensor of the batch, as `omniroll generate` writes it),
`rewards.jsonl` (one line per row: request_id, uid, seed, status, score, components, error) and `metrics.json`
(per-sample metrics, timing summary, weight versions).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

HELP = "the distributed path (replicas, agent loop, rewards) on local Ray"


def add_arguments(roll) -> None:
    roll.add_argument("--config", required=True, help="YAML rollout config (see examples/rollout.yaml)")
    roll.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    roll.add_argument("--prompts-file", dest="prompts_file", help="one prompt per line")
    roll.add_argument("--prompts", dest="prompts_file", help="alias of --prompts-file")
    roll.add_argument("--n", type=int, default=8, help="samples per prompt")
    roll.add_argument("--out", default="out/rollout", help="output directory")
    roll.add_argument("--override", action="append", help="dotted config override, e.g. reward.num_workers=2")
    roll.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args) -> int:
    import asyncio

    from omniroll.cli.generate import read_prompts
    from omniroll.config import load_config

    config = load_config(args.config, overrides=args.override or [])
    prompts = read_prompts(args)
    batch = asyncio.run(run_rollout(config, prompts, n=args.n, out_dir=args.out, progress=not args.quiet))
    print(json.dumps({"num_samples": len(batch), "out": args.out}))
    return 0


def make_batch(prompts: list[str], n: int, global_steps: int = 1, rollout_seed: Optional[int] = None,
               validate: bool = False):
    """`n` rows per prompt (interleaved: p0, p0, ..., p1, ...), uid = prompt position."""
    from omniroll.agent_loop.batch import DataBatch

    if not prompts:
        raise ValueError("prompts must not be empty")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rows = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
    meta = {"global_steps": global_steps, "validate": validate}
    if rollout_seed is not None:
        meta["rollout_seed"] = rollout_seed
    return DataBatch.from_dict(non_tensors={
        "raw_prompt": [p for _, p in rows], "uid": [f"prompt{i:05d}" for i, _ in rows],
        "data_source": ["cli"] * len(rows), "extra_info": [{} for _ in rows]}, meta_info=meta)


async def run_rollout(config: Any, prompts: list[str], n: int, out_dir: Optional[str] = None,
                      progress: bool = True):
    """Generate (and score) `n` samples per prompt with the config's replicas and reward workers; a DataBatch."""
    import ray

    from omniroll.agent_loop.manager import AgentLoopManager
    from omniroll.config import OmniRollConfig, load_config
    from omniroll.models import resolve_model
    from omniroll.rollout.replica import create_replicas, kill_replicas

    cfg = config if isinstance(config, OmniRollConfig) else load_config(config)
    batch = make_batch(prompts, n, rollout_seed=cfg.seed)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    say = (lambda msg: print(f"[omniroll] {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    t0 = time.perf_counter()
    model = resolve_model(cfg.engine.model)
    replicas, reward_handles, manager = [], [], None
    try:
        say(f"starting {cfg.replicas.count} replica(s) of {model}")
        replicas = create_replicas(cfg.replicas.count, model, cfg.engine.engine_kwargs(),
                                   num_cpus=cfg.replicas.num_cpus, num_gpus=cfg.replicas.num_gpus,
                                   max_concurrency=cfg.replicas.max_concurrency)
        if cfg.reward.functions and cfg.reward.num_workers > 0:
            from omniroll.reward import create_reward_workers

            reward_handles = create_reward_workers(cfg.reward.worker_config(), cfg.reward.num_workers)
        manager = AgentLoopManager(cfg, replicas, reward_handles or None)
        say(f"generating {len(batch)} samples ({len(prompts)} prompts x {n})")
        out = await manager.generate_sequences_async(batch)
        say(f"done in {time.perf_counter() - t0:.1f}s")
    finally:
        if manager is not None:
            manager.shutdown()
        for h in reward_handles:
            ray.kill(h, no_restart=True)
        kill_replicas(replicas)
    if out_dir:
        write_outputs(out, out_dir, fps=cfg.pipeline.fps)
        say(f"wrote {out_dir}")
    return out


def write_outputs(out, out_dir: str, fps: int = 16) -> None:
    import torch

    from omniroll.cli.media import save_sample

    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    nt = out.non_tensor_batch
    if "responses" in out.batch.keys() and out.batch["responses"].dtype == torch.uint8:
        for i, img in enumerate(out.batch["responses"]):
            if nt["status"][i] == "failed":
                continue
            stem = f"{i:04d}_{_safe(nt['uid'][i])}_{nt['_group_index'][i]}"
            save_sample(img, Path(out_dir) / "images" / stem, fps=fps)  # image: .png; video: .mp4 / .webp + strip
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in out.batch.items()}, os.path.join(out_dir, "trajectories.safetensors"),
              metadata={"uid": json.dumps([str(u) for u in nt["uid"]])})
    infos = nt.get("reward_extra_info", [None] * len(out))
    scores = out.batch["rm_scores"][:, 0].tolist() if "rm_scores" in out.batch.keys() else [None] * len(out)
    with open(os.path.join(out_dir, "rewards.jsonl"), "w") as f:
        for i in range(len(out)):
            info = infos[i] or {}
            f.write(json.dumps(_jsonable({
                "row": i, "request_id": nt["request_id"][i], "uid": nt["uid"][i], "seed": nt["seed"][i],
                "status": nt["status"][i], "score": scores[i] if scores[i] is not None else info.get("score"),
                "components": info.get("components"), "error": (nt.get("error", [None] * len(out))[i]
                                                                 or info.get("error")),
            })) + "\n")
    meta = {k: out.meta_info.get(k) for k in ("metrics", "timing", "min_weight_version", "max_weight_version",
                                             "reward_extra_keys", "global_steps")}
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(_jsonable(meta), f, indent=1)


def _safe(s: Any) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in str(s))[:64]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x if isinstance(x, (str, int, float, bool)) or x is None else repr(x)
