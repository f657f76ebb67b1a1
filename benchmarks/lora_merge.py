"""A LoRA merged into the engine's weights (`engine.merge_lora`) against the same LoRA unmerged and the base model.

    .venv/bin/python benchmarks/lora_merge.py [--rank 16] [--images 48] [--repeats 3] [--threads 2]

The workload of a CFG-free rollout of the shapes demo: `--images` pictures (the demo's grammar prompts, fixed seeds),
the shipped shapes model's 10 Euler ODE steps at guidance 1, one forward of all of them per step
(`max_batch_size` = images), decoded and quantised to uint8. Three engines draw the same requests:

(a) base: the shipped model, no adapter;
(b) unmerged: a LoRA of `--rank` on every linear of the transformer the demo adapts (PEFT's layers: the base matmul,
    then the adapter's two small matmuls, a scale and an add);
(c) merged: the same LoRA with `merge_lora=True` (one matmul with W + B A * scaling).

The LoRA's weights are random (lora_B scaled to move the pictures: `--scale`), sent through `WeightSender` as the
trainer sends them. Each engine is warmed up once; the three run interleaved, `--repeats` times, in a rotated
order; medians are the headline (best-of beside them). Also printed: how far the merged pictures are from the
unmerged ones (largest latent difference, relative to the latents' scale; pixels that differ, in levels of 255).
`--smoke` draws 4 pictures once (checks the script, not the speed). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import machine_info, quiet_libraries, record_loadavg, rnd, rotated

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]  # examples/shapes_demo.yaml's


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (the demo's: 16)")
    ap.add_argument("--scale", type=float, default=0.05, help="std of the random lora_B weights")
    ap.add_argument("--images", type=int, default=48, help="pictures per rollout (the demo's step: 6 prompts x 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="4 pictures, 1 repeat: checks the script, not the speed")
    args = ap.parse_args(argv)
    if args.smoke:
        args.images, args.repeats = 4, 1
    return args


def requests(images: int, tag: str):
    from omniroll import GenerationRequest, SamplingParams
    from omniroll.tasks.shapes.splits import split_prompts

    prompts = split_prompts("train")
    sp = SamplingParams(height=64, width=64, num_inference_steps=10, guidance_scale=1.0, max_sequence_length=12)
    return [GenerationRequest(request_id=f"{tag}{i}", prompt=prompts[(7 * i) % len(prompts)], seed=1000 + i,
                              sampling_params=sp) for i in range(images)]


def lora_module(engine, rank: int, scale: float):
    """A PEFT-wrapped copy of the engine's transformer with a random LoRA (lora_B ~ N(0, scale))."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    module = SD3Transformer2DModel.from_config(engine.adapter.denoiser.config)
    module.load_state_dict(engine.adapter.denoiser.state_dict())
    wrapped = get_peft_model(module.eval(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return wrapped


def pixel_diff(a, b) -> torch.Tensor:
    """Per-pixel |a - b| of two outputs' uint8 pictures, in levels of 255."""
    return (a.diffusion_output.int() - b.diffusion_output.int()).abs()


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.models import resolve_model
    from omniroll.weights import WeightSender

    info = machine_info(args.threads)
    path = resolve_model("shapes")
    kw = {"max_batch_size": args.images, "num_threads": args.threads}
    engines = {"base": DiffusionEngine.from_pretrained(path, **kw),
               "unmerged": DiffusionEngine.from_pretrained(path, **kw),
               "merged": DiffusionEngine.from_pretrained(path, merge_lora=True, **kw)}
    lora = lora_module(engines["base"], args.rank, args.scale)
    WeightSender([engines["unmerged"], engines["merged"]]).send(lora, version=1)
    print(f"shapes model, {args.images} CFG-free pictures x 10 steps per rollout, rank-{args.rank} LoRA on "
          f"{len(TARGETS)} module kinds, {args.threads} threads")

    # 1. warm-up, and how far merged pictures are from unmerged ones
    outs = {name: eng.generate(requests(args.images, f"w{name}")) for name, eng in engines.items()}
    lat = max(float((a.extra_fields["all_latents"] - b.extra_fields["all_latents"]).abs().max()
                    / b.extra_fields["all_latents"].abs().max()) for a, b in zip(outs["merged"], outs["unmerged"]))
    pix = [pixel_diff(a, b) for a, b in zip(outs["merged"], outs["unmerged"])]
    moved = [pixel_diff(a, b) for a, b in zip(outs["unmerged"], outs["base"])]
    agree = {"max_rel_latent_diff": lat, "max_pixel_diff": int(max(int(p.max()) for p in pix)),
             "pixels_differing": rnd(sum(int((p > 0).sum()) for p in pix) / sum(p.numel() for p in pix), 6),
             "lora_moves_pixels_by": int(max(int(m.max()) for m in moved))}

    # 2. the timed rollouts, interleaved
    times: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        for name in rotated(list(engines), rep):
            t0 = time.perf_counter()
            engines[name].generate(requests(args.images, f"r{rep}{name}"))
            times[name].append(time.perf_counter() - t0)
    for eng in engines.values():
        eng.shutdown()
    record_loadavg(info, "loadavg_end")

    med = {name: statistics.median(t) for name, t in times.items()}
    print("\n| engine | s per rollout (median) | best | vs base | vs unmerged |\n|---|---|---|---|---|")
    for name in engines:
        print(f"| {name} | {med[name]:.2f} | {min(times[name]):.2f} | {med[name] / med['base']:.2f}x | "
              f"{med[name] / med['unmerged']:.2f}x |")
    print(f"\nmerged vs unmerged pictures: latents within {lat:.2g} of their scale, pixels within "
          f"{agree['max_pixel_diff']} level(s) ({agree['pixels_differing']:.3%} of them differ); the LoRA moves "
          f"pixels by up to {agree['lora_moves_pixels_by']} against the base")
    print(json.dumps({"benchmark": "lora_merge", "rank": args.rank, "images": args.images, "repeats": args.repeats,
                      "seconds": {k: [rnd(x) for x in v] for k, v in times.items()},
                      "merged_over_unmerged": rnd(med["merged"] / med["unmerged"]),
                      "unmerged_over_base": rnd(med["unmerged"] / med["base"]),
                      "merged_over_base": rnd(med["merged"] / med["base"]), "agreement": agree, "machine": info}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
