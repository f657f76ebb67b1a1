"""`omniroll generate`: images with SDE log-probs on one in-process engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

HELP = "generate images with SDE log-probs on one engine"


def read_prompts(args) -> list[str]:
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


def add_arguments(gen) -> None:
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


def run(args) -> int:
    metrics = run_generate(args)
    print(json.dumps({k: metrics[k] for k in ("num_images", "seconds", "images_per_second")}))
    return 0


def run_generate(args) -> dict:
    import torch
    from safetensors.torch import save_file

    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.models import resolve_model
    from omniroll.sampling import derive_seed

    prompts = read_prompts(args)
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
