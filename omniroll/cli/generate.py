"""`omniroll generate`: images or videos with SDE log-probs on one in-process engine.

Writes `prompt_{i}.png` (the prompt's samples in one row) for images; for video, per sample
`prompt_{i}_s{j}.mp4` (or `.webp` without an H.264 encoder; `metrics.json` says which) and `prompt_{i}_s{j}_frames.png`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

HELP = "generate images or videos with SDE log-probs on one engine"


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("give at least one --prompt or a --prompts-file")
    return prompts


def add_arguments(gen) -> None:
    gen.add_argument("--model", default="tiny", help="'tiny' (SD3), 'tiny-<family>' (sd3, flux, qwen-image, wan, "
                     "wan2.2) or a local diffusers checkpoint directory (SD3, FLUX.1, Qwen-Image, Wan)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="one prompt per line")
    gen.add_argument("--n", type=int, default=4, help="samples per prompt")
    gen.add_argument("--steps", type=int, default=10)
    gen.add_argument("--guidance", type=float, default=4.5, help="CFG scale (FLUX.1: the distilled guidance)")
    gen.add_argument("--true-cfg", type=float, default=1.0, help="FLUX.1 only: real CFG on top (> 1)")
    gen.add_argument("--frames", type=int, default=1, help="video frames (Wan: 4k + 1); 1 for images")
    gen.add_argument("--fps", type=int, default=16, help="frames per second of written videos")
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
    keys = ("num_images", "seconds", "images_per_second") + (("video_format",) if metrics["video_format"] else ())
    print(json.dumps({k: metrics[k] for k in keys}))
    return 0


def run_generate(args) -> dict:
    import torch
    from safetensors.torch import save_file

    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.cli.media import save_sample, save_strip, video_encoder
    from omniroll.models import resolve_model
    from omniroll.sampling import derive_seed

    prompts = read_prompts(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(
        height=args.height, width=args.width, num_frames=args.frames, fps=args.fps,
        num_inference_steps=args.steps, guidance_scale=args.guidance, true_cfg_scale=args.true_cfg,
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
    written = []
    for i in range(len(prompts)):
        if images.ndim == 4:  # images: one PNG row per prompt
            written.append(save_strip(images[i * args.n:(i + 1) * args.n], out / f"prompt_{i:03d}.png"))
        else:  # video: one file (and a PNG strip of its frames) per sample
            for j in range(args.n):
                written += save_sample(images[i * args.n + j], out / f"prompt_{i:03d}_s{j}", fps=args.fps)
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
    if "expert_indices" in ef[0]:  # Wan 2.2: the denoiser of each recorded step
        traj["expert_indices"] = torch.stack([e["expert_indices"] for e in ef]).contiguous()
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
        "files": [p.name for p in written],
        "video_format": video_encoder() if images.ndim == 5 else None,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
