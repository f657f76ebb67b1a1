"""GPU rollout: omniroll's engine vs diffusers' own pipeline loop, same work, on an SD3.5-Medium-shaped random model
at 512 px (24 MMDiT-X layers, 24 heads x 64, dual attention in the first 13 layers, qk RMSNorm, 16-channel VAE at
full size; the text encoders keep SD3.5's widths with one layer each, since only their outputs' shapes matter here).

Runs only where CUDA is present (it says so and exits 0 elsewhere). Not yet run: the machine it was written on has no
GPU. Work: P prompts x n samples, T steps, CFG, 512 x 512, bf16. Contenders:
  diffusers   StableDiffusion3Pipeline(prompt=[P x n], num_inference_steps=T, guidance_scale, output_type="pt")
  omniroll    DiffusionEngine(device="cuda", dtype=bf16).generate(P x n requests), ODE (noise_level 0) and SDE
              (noise_level 0.7, Flow-GRPO window: every step but the last, fp32 log-probs recorded)
Each contender runs once to warm up, then `--repeats` times on new prompts each time (prompt encoding is part of the
work for both); best wall time counts. Prints a table of images/s and
the ratio to diffusers, then one JSON line. `--smoke` runs the same script on a tiny model on CPU (a check of the
script itself; its numbers mean nothing).

    python benchmarks/gpu_rollout.py --prompts 8 --n 2 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, make_prompts, quiet_libraries  # noqa: E402

SD35_MEDIUM = dict(
    transformer=dict(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                     attention_head_dim=64, num_attention_heads=24, pos_embed_max_size=384,
                     dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32),
    clip=dict(hidden_size=1024, intermediate_size=4096, projection_dim=1024, num_hidden_layers=1,
              num_attention_heads=16),
    t5=dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64, relative_attention_num_buckets=32),
)


def build(cache: str, smoke: bool) -> str:
    from omniroll.models.tiny import build_tiny_sd3

    if smoke:
        return build_tiny_sd3(os.path.join(cache, "tiny-sd3"), seed=0)
    return build_tiny_sd3(os.path.join(cache, "sd35-medium-shaped"), seed=0, preset="bench", **SD35_MEDIUM)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_diffusers(path, args, device, dtype) -> float:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    rep = [0]

    def once():
        rep[0] += 1
        batch = [p for p in make_prompts(args.prompts, run=rep[0]) for _ in range(args.n)]
        g = torch.Generator(device).manual_seed(0)
        sync(device)
        t0 = time.perf_counter()
        pipe(prompt=batch, num_inference_steps=args.steps, guidance_scale=args.guidance, height=args.size,
             width=args.size, max_sequence_length=args.max_sequence_length, generator=g, output_type="pt")
        sync(device)
        return time.perf_counter() - t0

    once()
    best = min(once() for _ in range(args.repeats))
    pipe = None  # frees the device memory before the next run
    return best


def run_engine(path, args, device, dtype, noise_level: float) -> float:
    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine

    engine = DiffusionEngine.from_pretrained(path, device=device, dtype=dtype, max_batch_size=args.max_batch_size)
    params = SamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                            guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length,
                            noise_level=noise_level)
    rep = [0]

    def once():
        rep[0] += 1  # new prompts every run: the engine's prompt cache never saves it an encoding diffusers does
        reqs = [GenerationRequest(request_id=f"{rep[0]}-{i}-{j}", prompt=p, seed=i * 100 + j, sampling_params=params)
                for i, p in enumerate(make_prompts(args.prompts, run=rep[0])) for j in range(args.n)]
        sync(device)
        t0 = time.perf_counter()
        engine.generate(reqs)
        sync(device)
        return time.perf_counter() - t0

    try:
        once()
        return min(once() for _ in range(args.repeats))
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--max-sequence-length", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=32, help="engine forward rows (a CFG sample takes two)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=os.environ.get("OMNIROLL_CACHE", ".omniroll_cache"))
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, not the speed")
    args = ap.parse_args()
    if args.smoke:
        device, dtype = "cpu", torch.float32
        args.size, args.steps, args.max_sequence_length, args.repeats = 64, 2, 16, 1
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
    else:
        print("gpu_rollout: no CUDA device here; nothing measured (run it on a GPU machine, or --smoke)")
        print(json.dumps({"benchmark": "gpu_rollout", "skipped": "no CUDA device"}))
        return 0
    quiet_libraries()
    info = machine_info(torch.get_num_threads())
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    path = build(args.cache, args.smoke)
    images = args.prompts * args.n
    seconds = {
        "diffusers": run_diffusers(path, args, device, dtype),
        "omniroll_ode": run_engine(path, args, device, dtype, 0.0),
        "omniroll_sde": run_engine(path, args, device, dtype, 0.7),
    }
    base = images / seconds["diffusers"]
    print(f"{'contender':<14} {'seconds':>9} {'images/s':>9} {'x diffusers':>12}")
    for name, s in seconds.items():
        print(f"{name:<14} {s:>9.3f} {images / s:>9.3f} {images / s / base:>12.3f}")
    print(json.dumps({"benchmark": "gpu_rollout", "device": device, "smoke": args.smoke, "images": images,
                      "steps": args.steps, "size": args.size, "seconds": seconds,
                      "ratio_vs_diffusers": {k: seconds["diffusers"] / v for k, v in seconds.items()},
                      "machine": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
