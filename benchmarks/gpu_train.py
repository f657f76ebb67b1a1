"""The trainer on GPUs, the device check (docs/training/gpu.md): short Flow-GRPO runs of each training mode on the
SD3.5-Medium-shaped random model at 512 px that benchmarks/gpu_rollout.py builds (no hub), then gpu_rollout.py's
engine vs diffusers images/s on the same model.

Modes, each `--steps` steps of P prompts x n samples (the first step a warm-up), bf16, one replica:
  lora        LoRA (rank 32) on the bf16 base; the replica on GPU 0, the trainer on cuda:1 when there is one (else
              beside the replica on cuda:0, both resident)
  full        full fine-tuning: fp32 master weights and AdamW moments, the forward under bf16 autocast
  colocated   LoRA, replica and trainer on cuda:0; the replica sleeps (level 1) before every update, wakes for the sync
  fsdp        full fine-tuning on N - 1 ranks with FSDP2 (trainer.sharding: fsdp), the replica on the N-th GPU
              (needs N >= 3: one replica GPU, two ranks)
Per step: rollout images/s, recompute (the anchors before the update), update and sync seconds, sleep and wake
seconds (colocated), peak memory per stage (rollout, recompute, update, sync), ratio_max_abs_dev. A table, then one
JSON line. Runs only where CUDA is present (elsewhere one line, exit 0); `--smoke` runs the lora and colocated modes
and the rollout comparison on a tiny model on the CPU (a check of the script: its numbers mean nothing).

    python benchmarks/gpu_train.py --steps 3
    python benchmarks/gpu_train.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import TRAIN_PROMPTS, machine_info, quiet_libraries  # noqa: E402
from gpu_rollout import build, run_diffusers, run_engine  # noqa: E402

STAGES = ("rollout", "recompute", "update", "sync")


def modes_for(gpus: int, smoke: bool) -> list[str]:
    if smoke:
        return ["lora", "colocated"]
    return ["lora", "full", "colocated"] + (["fsdp"] if gpus >= 3 else [])


def mode_config(args, mode: str, model: str, gpus: int):
    """The run of one mode (module doc)."""
    from omniroll.config import load_config

    cpu = args.smoke
    full = mode in ("full", "fsdp")
    trainer = {"prompts": TRAIN_PROMPTS[:args.prompts], "prompts_per_step": args.prompts, "steps": args.steps,
               "lr": 1e-4 if full else 3e-4, "mode": "full" if full else "lora", "lora": {"rank": 32, "alpha": 32},
               "micro_batch_size": args.micro_batch_size, "policy_move_rows": 0, "log_images_every": 0,
               "logger": ["jsonl"], "num_threads": 1 if cpu else None}
    replicas = {"count": 1, "num_cpus": 1, "num_gpus": 0 if cpu else 1}
    if mode == "lora" and gpus >= 2:
        trainer["device"] = "cuda:1"
    if mode == "colocated":
        replicas.update(colocate=True, sleep_level=1)
    if mode == "fsdp":
        trainer.update(world_size=gpus - 1, sharding="fsdp", resources={"num_cpus": 1, "num_gpus": 1})
    return load_config({
        "replicas": replicas,
        "engine": {"model": model, "device": "cpu" if cpu else "cuda", "dtype": "float32" if cpu else "bfloat16",
                   "max_batch_size": args.max_batch_size, "num_threads": 1 if cpu else None},
        "pipeline": {"height": args.size, "width": args.size, "num_inference_steps": args.sampling_steps,
                     "guidance_scale": 4.5, "max_sequence_length": args.max_sequence_length},
        "algo": {"noise_level": 0.7, "sde_type": "sde", "sde_window_size": args.window,
                 "sde_window_range": [0, args.sampling_steps - 1]},
        "agent": {"num_workers": 1}, "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"}}},
        "n": args.n, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1}, "trainer": trainer,
    })


def run_mode(args, mode: str, model: str, gpus: int) -> list[dict]:
    """One mode's steps: the figures of each (module doc)."""
    from omniroll.train import Trainer

    out = os.path.join(args.out, mode)
    rows = []
    with Trainer(mode_config(args, mode, model, gpus), out, log=lambda s: None) as tr:
        for m in tr.train():
            rows.append({"mode": mode, "step": m["step"], "images_per_s": m["num_samples"] / max(m["rollout_s"], 1e-9),
                         "recompute_s": m["recompute_s"], "update_s": m["train_s"] - m["recompute_s"],
                         "sync_s": m["sync_s"], "sleep_s": m.get("sleep_s"), "wake_s": m.get("wake_s"),
                         "ratio_max_abs_dev": m["ratio_max_abs_dev"],
                         **{f"peak_{s}_gb": m.get(f"peak_mem_{s}_gb") for s in STAGES}})
    return rows


def rollout_comparison(args, model: str, device: str, dtype: torch.dtype) -> dict:
    """gpu_rollout.py's contenders on the same model: images/s of diffusers' pipeline and the engine (ODE, SDE)."""
    ns = argparse.Namespace(prompts=args.prompts, n=args.n, steps=args.sampling_steps, size=args.size, guidance=4.5,
                            max_sequence_length=args.max_sequence_length, max_batch_size=args.max_batch_size,
                            repeats=1 if args.smoke else 3)
    images = args.prompts * args.n
    seconds = {"diffusers": run_diffusers(model, ns, device, dtype),
               "omniroll_ode": run_engine(model, ns, device, dtype, 0.0),
               "omniroll_sde": run_engine(model, ns, device, dtype, 0.7)}
    return {k: images / s for k, s in seconds.items()}


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="training steps per mode (the first is a warm-up)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--sampling-steps", type=int, default=10)
    ap.add_argument("--window", type=int, default=2, help="SDE window steps trained per sample")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--max-sequence-length", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=32, help="engine forward rows (a CFG sample takes two)")
    ap.add_argument("--cache", default=os.environ.get("OMNIROLL_CACHE", ".omniroll_cache"))
    ap.add_argument("--out", default="out/gpu_train")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, not the speed")
    args = ap.parse_args()
    if args.smoke:
        device, dtype, gpus = "cpu", torch.float32, 0
        args.steps, args.prompts, args.n, args.size, args.sampling_steps = 1, 2, 2, 32, 3
        args.max_sequence_length, args.micro_batch_size, args.max_batch_size = 16, 4, 16
    elif torch.cuda.is_available():
        device, dtype, gpus = "cuda", torch.bfloat16, torch.cuda.device_count()
    else:
        print(json.dumps({"benchmark": "gpu_train", "skipped": "no CUDA device here: nothing measured (run it on a "
                                                               "GPU machine, or --smoke)"}))
        return 0
    import ray

    quiet_libraries()
    info = machine_info(torch.get_num_threads())
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    model = build(args.cache, args.smoke)
    ray.init(address="local", num_cpus=4 if args.smoke else None, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        rows = [r for mode in modes_for(gpus, args.smoke) for r in run_mode(args, mode, model, gpus)]
    finally:
        ray.shutdown()
    rollout = rollout_comparison(args, model, device, dtype)
    print(f"{'mode':<10} {'step':>4} {'img/s':>7} {'recomp s':>8} {'update s':>8} {'sync s':>7} {'sleep s':>7} "
          f"{'wake s':>7} {'ratio_dev':>9} " + " ".join(f"{'GiB ' + s:>13}" for s in STAGES))
    for r in rows:
        print(f"{r['mode']:<10} {r['step']:>4} {r['images_per_s']:>7.2f} {r['recompute_s']:>8.2f} "
              f"{r['update_s']:>8.2f} {r['sync_s']:>7.2f} {fmt(r['sleep_s'], '7.2f'):>7} {fmt(r['wake_s'], '7.2f'):>7} "
              f"{r['ratio_max_abs_dev']:>9.1e} " + " ".join(f"{fmt(r[f'peak_{s}_gb'], '.2f'):>13}" for s in STAGES))
    print("rollout, images/s: " + "  ".join(f"{k} {v:.2f} (x{v / rollout['diffusers']:.2f})"
                                             for k, v in rollout.items()))
    print(json.dumps({"benchmark": "gpu_train", "device": device, "smoke": args.smoke, "gpus": gpus,
                      "steps": rows, "rollout_images_per_s": rollout, "machine": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
