"""Command line: `omniroll generate`, `omniroll demo`, `omniroll rollout`, `omniroll serve`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEMO_PROMPTS = [
    "a photo of a red car in front of a house",
    "a blue bird sitting on a tree",
    "a cat and a dog playing in the park",
]


def _prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("give at least one --prompt or a --prompts-file")
    return prompts


def save_grid(images, path: Path) -> None:
    """images: uint8 tensor [N, 3, H, W] -> one PNG row."""
    from PIL import Image

    grid = images.permute(2, 0, 3, 1).reshape(images.shape[2], -1, 3).numpy()  # H, N*W, 3
    Image.fromarray(grid).save(path)


def run_generate(args) -> dict:
    import torch
    from safetensors.torch import save_file

    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.models import resolve_model
    from omniroll.sampling import derive_seed

    prompts = _prompts(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(
        height=args.height, width=args.width, num_inference_steps=args.steps, guidance_scale=args.guidance,
        max_sequence_length=args.max_sequence_length, noise_level=args.noise_level, sde_type=args.sde_type,
        sde_window_size=args.window_size, sde_window_range=tuple(args.window_range) if args.window_range else None,
    )
    engine = DiffusionEngine.from_pretrained(resolve_model(args.model), max_batch_size=args.max_batch_size)
    requests = [
        GenerationRequest(request_id=f"p{i}-s{j}", prompt=p, sampling_params=params,
                          seed=derive_seed(args.seed, 0, f"{i}:{p}", j))
        for i, p in enumerate(prompts) for j in range(args.n)
    ]
    t0 = time.perf_counter()
    outputs = engine.generate(requests, progress=not args.quiet)
    seconds = time.perf_counter() - t0
    engine.shutdown()

    images = torch.stack([o.diffusion_output for o in outputs])
    for i in range(len(prompts)):
        save_grid(images[i * args.n:(i + 1) * args.n], out / f"prompt_{i:03d}.png")
    ef = [o.extra_fields for o in outputs]
    traj = {
        "images": images.contiguous(),
        "all_latents": torch.stack([e["all_latents"] for e in ef]).contiguous(),
        "all_timesteps": torch.stack([e["all_timesteps"] for e in ef]).contiguous(),
        "sigmas": torch.stack([e["sigmas"] for e in ef]).contiguous(),
        "sigmas_next": torch.stack([e["sigmas_next"] for e in ef]).contiguous(),
        "log_probs": torch.stack([o.log_probs for o in outputs]).contiguous(),
        "seeds": torch.tensor([e["seed"] for e in ef], dtype=torch.int64),
        "prompt_index": torch.tensor([i for i in range(len(prompts)) for _ in range(args.n)], dtype=torch.int64),
    }
    save_file(traj, str(out / "trajectories.safetensors"),
              metadata={"prompts": json.dumps(prompts), "sampling_params": params.model_dump_json()})
    metrics = {
        "num_images": len(outputs),
        "seconds": seconds,
        "images_per_second": len(outputs) / seconds,
        "mean_log_prob": float(traj["log_probs"].mean()) if traj["log_probs"].numel() else None,
        "sde_window": [list(e["sde_window"]) for e in ef],
        "engine": engine.stats(),
        "sampling_params": params.model_dump(),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def run_rollout(args) -> dict:
    import asyncio

    from omniroll.agent_loop.runner import run_rollout as _run
    from omniroll.config import load_config

    config = load_config(args.config, overrides=args.override or [])
    prompts = _prompts(args)
    batch = asyncio.run(_run(config, prompts, n=args.n, out_dir=args.out, progress=not args.quiet))
    return {"num_samples": len(batch), "out": args.out}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniroll", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate images with SDE log-probs on one engine")
    gen.add_argument("--model", default="tiny", help="'tiny' or a local diffusers SD3 checkpoint directory")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="one prompt per line")
    gen.add_argument("--n", type=int, default=4, help="samples per prompt")
    gen.add_argument("--steps", type=int, default=10)
    gen.add_argument("--guidance", type=float, default=4.5)
    gen.add_argument("--noise-level", type=float, default=0.7)
    gen.add_argument("--sde-type", default="sde", choices=["sde", "cps", "ode"])
    gen.add_argument("--window-size", type=int, default=None)
    gen.add_argument("--window-range", type=int, nargs=2, default=None)
    gen.add_argument("--height", type=int, default=128)
    gen.add_argument("--width", type=int, default=128)
    gen.add_argument("--max-sequence-length", type=int, default=32)
    gen.add_argument("--max-batch-size", type=int, default=16)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", default="out/generate")
    gen.add_argument("--quiet", action="store_true")

    demo = sub.add_parser("demo", help="build the tiny model (cached) and generate for a few bundled prompts")
    demo.add_argument("--out", default="out/demo")

    roll = sub.add_parser("rollout", help="the distributed path (replicas, agent loop, rewards) on local Ray")
    roll.add_argument("--config", required=True)
    roll.add_argument("--prompt", action="append")
    roll.add_argument("--prompts-file", dest="prompts_file")
    roll.add_argument("--prompts", dest="prompts_file", help="alias of --prompts-file")
    roll.add_argument("--n", type=int, default=8)
    roll.add_argument("--out", default="out/rollout")
    roll.add_argument("--override", action="append", help="dotted config override, e.g. reward.num_workers=2")
    roll.add_argument("--quiet", action="store_true")

    srv = sub.add_parser("serve", help="serve the OpenAI images API (and /v1/rollout, /metrics) over HTTP")
    srv.add_argument("--model", default="tiny", help="'tiny' or a local diffusers SD3 checkpoint directory")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    srv.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    srv.add_argument("--served-model-name", help="the model id in /v1/models (default: the model's name)")
    srv.add_argument("--max-batch-size", type=int, default=16)
    srv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    srv.add_argument("--max-pending", type=int, default=1024, help="samples in flight before 503 overloaded")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            gen_args = build_parser().parse_args(["generate", "--out", args.out, "--n", "4", "--steps", "8"]
                                                 + sum([["--prompt", p] for p in DEMO_PROMPTS], []))
            metrics = run_generate(gen_args)
            out = Path(args.out).resolve()
            print(f"\nomniroll demo: {metrics['num_images']} images in {metrics['seconds']:.1f} s "
                  f"({metrics['images_per_second']:.1f} img/s) on the embedded tiny model")
            for name in sorted(os.listdir(out)):
                print(f"  {out / name}")
        elif args.command == "generate":
            metrics = run_generate(args)
            print(json.dumps({k: metrics[k] for k in ("num_images", "seconds", "images_per_second")}))
        elif args.command == "rollout":
            print(json.dumps(run_rollout(args)))
        elif args.command == "serve":
            from omniroll.rollout.serve import ServeConfig, serve

            serve(ServeConfig(model=args.model, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                              served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                              max_pending=args.max_pending))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"omniroll: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
