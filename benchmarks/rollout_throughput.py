"""Rollout throughput: the omniroll engine vs flow_grpo's rollout loop vs the forward-only bound.

    .venv/bin/python benchmarks/rollout_throughput.py [--prompts 4] [--n 4] [--steps 10] [--repeats 3]

Every contender does the same work: P prompts x n samples, T steps, CFG (default 4.5, so 2 forward rows per image
per step), an SDE window of `--window-size` steps drawn in `--window-range` (noise 0.7, sde type "sde"), log-probs
recorded over the window, one VAE decode per image, uint8 pixels. Same bench SD3 checkpoint (built once into
`--cache-dir`), same dtype (fp32), same torch threads (`--threads`, default 2), same prompts per repeat.

(a) omniroll: `DiffusionEngine.generate` of all P*n requests at once (continuous step-level batching, `--engine-batch`
    forward rows; a prompt is encoded once however many samples use it), batch_invariant=True (the default) and
    batch_invariant=False. The engine's prompt cache is cleared before every timed run (each rollout of an RL run
    brings new prompts) and every repeat uses prompts never seen before, so no contender reuses an encoding.
(b) flow_grpo: a faithful reimplementation of `train_sd3.py` + `pipeline_with_logprob` (Flow-GRPO-Fast window):
    the K-repeat sampler's expanded prompt list cut into fixed batches of `--batch-size` images, the negative prompt
    "" encoded once before the loop, each batch's prompts encoded per image with `pipe.encode_prompt`, randn
    latents, `scheduler.set_timesteps`, one window per batch, [uncond, cond] concatenation -> transformer -> CFG ->
    `sde_step` with the per-sample sigma lookup (`scheduler.index_for_timestep` per batch element) and a noise draw
    every step (as `sde_step_with_logprob`), ODE (eta 0) outside the window, latents / log-probs / timesteps of the
    window recorded and stacked, `vae.decode` of the batch, `image_processor.postprocess` -> uint8.
(c) bound: the fastest configuration of the same work, timed directly on the adapter's modules: every forward row
    the workload needs (P*n images x T steps x 2 CFG rows) in forwards of R* rows, the row count with the lowest
    measured cost per row, one text encode per unique prompt (+1 negative), the VAE decodes in blocks of D* images,
    the block size with the lowest measured cost per image. R* and D* are picked by a sweep in this very run
    (printed) on the bound's own inputs (its real prompt encodings; every candidate does the same work: 32 rows, 8
    images; median of `--sweep-repeats`). No sampler, no bookkeeping, no per-request overhead, no invariance.
    efficiency = (a) / (c).

First the sweeps (rows per forward vs ms per row, plain and batch-invariant; images per decode vs s per image) pick
the bound's R* and D*. Each contender is then warmed up once (every forward / decode shape of its timed runs, with
fewer images and steps), and the contenders run interleaved, `--repeats` times, in a rotated order. The machine may
be shared and noisy: medians are the headline figures, best-of-repeats (noise only ever adds time) are printed beside
them; the load average at start and end is recorded. `--smoke` runs a tiny setting in about a minute (checks the
script, not the speed). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from _common import (add_run_args, add_workload_args, build_model, machine_info, make_prompts,  # noqa: E402
                     quiet_libraries, record_loadavg, rnd, rotated)
from _flowgrpo_loop import flowgrpo_rollout  # noqa: E402


# --------------------------------------------------------------------------------------------------- setup
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, prompts=4, steps=10, size=256)
    ap.add_argument("--batch-size", type=int, default=4, help="flow_grpo's fixed sampling batch (images)")
    ap.add_argument("--engine-batch", default="16",
                    help='omniroll max_batch_size (forward rows per batch key; 16, the engine default), or "auto" '
                         '(the engine measures)')
    ap.add_argument("--layers", type=int, default=4, help="transformer layers of the bench model")
    add_run_args(ap, threads=2)
    ap.add_argument("--sweep-rows", type=int, nargs="*", default=[2, 4, 8, 16, 32])
    ap.add_argument("--sweep-decode", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--sweep-repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny setting (1 prompt x 2, 64 px, 1 repeat): checks the script")
    ap.add_argument("--skip", nargs="*", default=[], choices=["omniroll", "omniroll_noninvariant", "flowgrpo", "bound"],
                    help="contenders to leave out (quick experiments)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.height, args.width, args.repeats, args.max_sequence_length = 1, 2, 64, 64, 1, 16
        args.sweep_rows, args.sweep_decode, args.sweep_repeats = [2, 4], [1, 2], 1
    if args.engine_batch != "auto":
        args.engine_batch = int(args.engine_batch)
        if args.engine_batch < 2:
            ap.error("--engine-batch must be >= 2 or auto")
    if args.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    return args


def sampling_params(args):
    from omniroll.engine.params import SamplingParams

    return SamplingParams(
        height=args.height, width=args.width, num_inference_steps=args.steps, guidance_scale=args.guidance,
        max_sequence_length=args.max_sequence_length, noise_level=args.noise_level, sde_type="sde",
        sde_window_size=args.window_size, sde_window_range=tuple(args.window_range), logprobs=True,
        output_type="pixel",
    )


# --------------------------------------------------------------------------------------------------- (a) omniroll
def omniroll_rollout(engine, prompts: list[str], args, run: int) -> dict:
    from omniroll.engine.params import GenerationRequest

    params = sampling_params(args)
    requests = [
        GenerationRequest(request_id=f"r{run}-p{i}-s{j}", prompt=p, negative_prompt="", sampling_params=params,
                          seed=args.seed * 1_000_003 + run * 10_007 + i * args.n + j)
        for i, p in enumerate(prompts) for j in range(args.n)
    ]
    engine.call_between_steps(engine.prompt_cache.clear)  # a new rollout: nothing encoded yet (not timed)
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    dt = time.perf_counter() - t0
    imgs = [o.diffusion_output for o in outs]
    assert len(imgs) == len(requests) and all(o.stop_reason == "completed" for o in outs)
    assert all(i.dtype == torch.uint8 and tuple(i.shape) == (3, args.height, args.width) for i in imgs)
    assert all(o.log_probs.shape == (args.window_size,) and torch.isfinite(o.log_probs).all() for o in outs)
    return {"seconds": dt, "images": len(imgs)}


# --------------------------------------------------------------------------------------------------- (c) bound
def bound_forward_plan(total_rows: int, rows: int) -> list[int]:
    """Forwards of `rows` rows (the last one takes the rest) covering `total_rows`."""
    return [rows] * (total_rows // rows) + ([total_rows % rows] if total_rows % rows else [])


class BoundInputs:
    """The bound's model inputs for one rollout: one text encode per unique prompt (+ the negative ""), their
    encodings cycled over `rows` forward rows, random latents and per-row timesteps. The sweep times forwards on
    exactly these inputs, so the rows it picks are the rows the bound then runs."""

    def __init__(self, adapter, prompts: list[str], args, rows: int, seed: int):
        pipe = adapter.pipeline
        g = torch.Generator().manual_seed(seed)
        C, h, w = adapter.latent_shape(args.height, args.width)
        enc = [pipe.encode_prompt(prompt=[p], prompt_2=None, prompt_3=None, device=adapter.device,
                                  num_images_per_prompt=1, do_classifier_free_guidance=False,
                                  max_sequence_length=args.max_sequence_length)
               for p in list(dict.fromkeys(prompts)) + [""]]
        reps = (rows + len(enc) - 1) // len(enc)
        self.pe = torch.cat([e[0] for e in enc]).repeat(reps, 1, 1)[:rows]
        self.ppe = torch.cat([e[2] for e in enc]).repeat(reps, 1)[:rows]
        self.lat = torch.randn(rows, C, h, w, generator=g)
        self.t = torch.linspace(1000.0, 100.0, rows)
        self.transformer = adapter.transformer

    def forward(self, rows: int) -> None:
        self.transformer(hidden_states=self.lat[:rows], timestep=self.t[:rows], encoder_hidden_states=self.pe[:rows],
                         pooled_projections=self.ppe[:rows], return_dict=False)


@torch.no_grad()
def bound_rollout(adapter, prompts: list[str], args, run: int, rows: int, decode_batch: int) -> dict:
    vae = adapter.vae
    rows_per_image = 2 if args.guidance > 1.0 else 1
    n_img = len(prompts) * args.n
    plan = bound_forward_plan(n_img * rows_per_image * args.steps, rows)
    C, h, w = adapter.latent_shape(args.height, args.width)
    g = torch.Generator().manual_seed(run)
    dec_in = torch.randn(n_img, C, h, w, generator=g) / vae.config.scaling_factor + vae.config.shift_factor
    phases = {"encode": 0.0, "denoise": 0.0, "decode": 0.0}

    t_start = time.perf_counter()
    t0 = time.perf_counter()
    inputs = BoundInputs(adapter, prompts, args, rows, run)
    phases["encode"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in plan:
        inputs.forward(r)
    phases["denoise"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for chunk in dec_in.split(decode_batch):
        vae.decode(chunk, return_dict=False)
    phases["decode"] = time.perf_counter() - t0
    return {"seconds": time.perf_counter() - t_start, "images": n_img, "phases": phases, "forwards": len(plan)}


# --------------------------------------------------------------------------------------------------- sweeps
@torch.no_grad()
def decode_sweep(adapter, args, blocks: list[int], repeats: int) -> dict:
    """Seconds per image vs images per VAE decode: every block size decodes the same `max(blocks)` images (so each
    measurement is the same work), interleaved in alternating order, after a warm-up; the median is kept."""
    vae = adapter.vae
    C, h, w = adapter.latent_shape(args.height, args.width)
    x = torch.randn(max(blocks), C, h, w, generator=torch.Generator().manual_seed(0))
    for b in blocks:
        vae.decode(x[:b], return_dict=False)
    samples = {b: [] for b in blocks}
    for rep in range(repeats):
        for b in (blocks if rep % 2 == 0 else list(reversed(blocks))):
            t0 = time.perf_counter()
            for chunk in x.split(b):
                vae.decode(chunk, return_dict=False)
            samples[b].append((time.perf_counter() - t0) / len(x))
    return {b: statistics.median(v) for b, v in samples.items()}


@torch.no_grad()
def forward_sweep(adapter, args, rows_list: list[int], repeats: int, block_rows: int) -> dict:
    """ms per row vs rows per forward, plain and in batch-invariant mode, on the bound's own inputs (real prompt
    encodings, see BoundInputs). Every measurement runs the same number of rows (max(rows_list), in forwards of the
    candidate size), interleaved in alternating order, after a warm-up of every shape; the median is kept."""
    from omniroll.engine.execution import BatchInvariantMode

    total = max(rows_list)
    inputs = BoundInputs(adapter, make_prompts(args.prompts, -1), args, total, seed=0)
    modes = {"plain": contextlib.nullcontext, "invariant": lambda: BatchInvariantMode(block_rows)}
    samples = {m: {r: [] for r in rows_list} for m in modes}
    for mode, ctx in modes.items():
        for rows in rows_list:
            with ctx():
                inputs.forward(rows)
    for rep in range(repeats):
        for mode, ctx in (modes.items() if rep % 2 == 0 else reversed(list(modes.items()))):
            for rows in (rows_list if rep % 2 == 0 else list(reversed(rows_list))):
                t0 = time.perf_counter()
                with ctx():
                    for r in bound_forward_plan(total, rows):
                        inputs.forward(r)
                samples[mode][rows].append((time.perf_counter() - t0) * 1000 / total)
    return {m: {r: statistics.median(v) for r, v in d.items()} for m, d in samples.items()}


# --------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_libraries(("diffusers", "transformers"))
    from diffusers import StableDiffusion3Pipeline

    from omniroll.engine.engine import DiffusionEngine

    info = machine_info(args.threads)
    t_setup = time.perf_counter()
    path = build_model(args.cache_dir, "bench", None if args.layers == 4 else args.layers)
    engines = {
        "omniroll": DiffusionEngine.from_pretrained(path, max_batch_size=args.engine_batch, batch_invariant=True),
        "omniroll_noninvariant": DiffusionEngine.from_pretrained(path, max_batch_size=args.engine_batch,
                                                                 batch_invariant=False),
    }
    from diffusers.utils import deprecation_utils

    # diffusers renamed `torch_dtype` to `dtype` (0.36+); the same check as SD3Adapter.from_pretrained
    dtype_key = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    pipe = StableDiffusion3Pipeline.from_pretrained(path, local_files_only=True, **{dtype_key: torch.float32})
    pipe.set_progress_bar_config(disable=True)
    pipe.to("cpu")
    bound_adapter = engines["omniroll_noninvariant"].adapter
    # the engine's loop thread does the math: check that it runs with the same thread count
    engine_threads = engines["omniroll"].call_between_steps(torch.get_num_threads)
    assert engine_threads == args.threads, f"engine thread uses {engine_threads} threads, not {args.threads}"

    contenders = {
        "omniroll": lambda prompts, run, a=args: omniroll_rollout(engines["omniroll"], prompts, a, run),
        "omniroll_noninvariant": lambda prompts, run, a=args: omniroll_rollout(engines["omniroll_noninvariant"],
                                                                               prompts, a, run),
        "flowgrpo": lambda prompts, run, a=args: flowgrpo_rollout(pipe, prompts, a, run),
        "bound": lambda prompts, run, a=args: bound_rollout(bound_adapter, prompts, a, run, best_rows, best_decode),
    }
    for name in args.skip:
        contenders.pop(name)
    names = list(contenders)
    n_img = args.prompts * args.n
    print(f"# rollout throughput: {args.prompts} prompts x {args.n} samples = {n_img} images, T={args.steps}, "
          f"CFG {args.guidance}, SDE window {args.window_size} in {tuple(args.window_range)} (eta "
          f"{args.noise_level}, sde), {args.height}x{args.width}, L={args.max_sequence_length}, "
          f"{args.layers} transformer layers, fp32, {args.threads} threads", flush=True)
    print(f"# flow_grpo batch {args.batch_size} images ({2 * args.batch_size} CFG rows); omniroll max_batch_size "
          f"{args.engine_batch} rows; machine: {info['cpu']} x{info['cpu_count']}, load {info.get('loadavg_start')}; "
          f"setup {time.perf_counter() - t_setup:.1f}s", flush=True)

    # The sweeps pick the bound's configuration: the fastest rows per forward and images per decode (plain mode).
    sweep = forward_sweep(bound_adapter, args, args.sweep_rows, args.sweep_repeats,
                          engines["omniroll"].config.invariant_block_rows)
    dsweep = decode_sweep(bound_adapter, args, args.sweep_decode, args.sweep_repeats)
    best_rows = min(args.sweep_rows, key=lambda r: sweep["plain"][r])
    best_decode = min(args.sweep_decode, key=lambda b: dsweep[b])
    print("| rows/forward | plain ms/row | invariant ms/row | invariant overhead |")
    print("|-------------:|-------------:|-----------------:|-------------------:|")
    for rows in args.sweep_rows:
        p, i = sweep["plain"][rows], sweep["invariant"][rows]
        print(f"| {rows:12d} | {p:12.1f} | {i:16.1f} | {100 * (i / p - 1):+17.1f}% |")
    print("| images/decode | s/image |")
    print("|--------------:|--------:|")
    for b in args.sweep_decode:
        print(f"| {b:13d} | {dsweep[b]:7.3f} |")
    print(f"# bound: {best_rows} rows per forward, {best_decode} images per decode (the fastest measured)", flush=True)

    results: dict[str, list[dict]] = {k: [] for k in names}
    run = 0
    # Warm-up (not timed): every contender once on this workload's images with fewer steps (the window's end):
    # every forward / decode shape of the timed runs, and the engines' own calibration of their forward rows.
    warm = argparse.Namespace(**vars(args))
    warm.steps = max(args.window_range[1], 1)
    for name in names:
        r = contenders[name](make_prompts(warm.prompts, run), run, warm)
        print(f"  warm-up {name:<22} {r['seconds']:7.2f}s", flush=True)
    engine_rows = {k: sorted(set(e.scheduler.key_rows.values())) for k, e in engines.items()}
    print(f"# engine forward rows (max_batch_size={args.engine_batch}): {engine_rows}", flush=True)
    for rep in range(args.repeats):
        run += 1
        prompts = make_prompts(args.prompts, run)  # fresh prompts, the same for every contender of this repeat
        order = rotated(names, rep)
        for name in order:
            c0 = time.process_time()
            r = contenders[name](prompts, run)
            r["cpu_s"] = time.process_time() - c0  # CPU seconds of this process: less sensitive to other tenants
            results[name].append(r)
            extra = "  " + " ".join(f"{k} {v:.2f}s" for k, v in r["phases"].items()) if "phases" in r else ""
            print(f"  repeat {rep} {name:<22} {r['seconds']:7.2f}s  {r['images'] / r['seconds']:6.3f} img/s{extra}",
                  flush=True)

    med = {k: statistics.median(x["seconds"] for x in v) for k, v in results.items()}
    ips = {k: n_img / v for k, v in med.items()}
    best_s = {k: min(x["seconds"] for x in v) for k, v in results.items()}  # noise only ever adds time
    best_ips = {k: n_img / v for k, v in best_s.items()}
    ratio = lambda a, b: (ips[a] / ips[b]) if a in ips and b in ips else None  # noqa: E731

    print()
    print("| contender                     | median s | images/s | vs flow_grpo | vs bound | best s | best img/s |")
    print("|-------------------------------|---------:|---------:|-------------:|---------:|-------:|-----------:|")
    labels = {"omniroll": "(a) omniroll (invariant)", "omniroll_noninvariant": "(a') omniroll (non-invariant)",
              "flowgrpo": "(b) flow_grpo loop", "bound": "(c) honest bound"}
    for k in names:
        vs_b = f"{ratio(k, 'flowgrpo'):.2f}x" if ratio(k, "flowgrpo") else "-"
        vs_c = f"{ratio(k, 'bound'):.3f}" if ratio(k, "bound") else "-"
        print(f"| {labels[k]:<29} | {med[k]:8.2f} | {ips[k]:8.3f} | {vs_b:>12} | {vs_c:>8} | {best_s[k]:6.2f} | "
              f"{best_ips[k]:10.3f} |")
    for k in ("flowgrpo", "bound"):
        if k in results:
            ph = {p: statistics.median(x["phases"][p] for x in results[k]) for p in results[k][0]["phases"]}
            print(f"# {k} phases (median s): " + ", ".join(f"{p} {v:.2f}" for p, v in ph.items()))
    speedup = ratio("omniroll", "flowgrpo")
    efficiency = ratio("omniroll", "bound")
    inv_overhead = (med["omniroll"] / med["omniroll_noninvariant"] - 1) if {"omniroll", "omniroll_noninvariant"} <= \
        set(med) else None
    if speedup is not None:
        print(f"speed-up (a)/(b) = {speedup:.2f}x (target >= 1.0); non-invariant "
              f"{ratio('omniroll_noninvariant', 'flowgrpo'):.2f}x")
    if efficiency is not None:
        print(f"efficiency (a)/(c) = {efficiency:.3f} (target >= 0.95); non-invariant "
              f"{ratio('omniroll_noninvariant', 'bound'):.3f}")
    cpu = {k: statistics.median(x["cpu_s"] for x in v) for k, v in results.items()}
    cpu_ratio = lambda a, b: (cpu[b] / cpu[a]) if a in cpu and b in cpu else None  # noqa: E731
    print("# median CPU seconds of this process: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    if {"omniroll", "flowgrpo", "bound"} <= set(cpu):
        print(f"CPU-time figures: speed-up {cpu_ratio('omniroll', 'flowgrpo'):.2f}x, efficiency "
              f"{cpu_ratio('omniroll', 'bound'):.3f}")
    best_ratio = lambda a, b: (best_ips[a] / best_ips[b]) if a in best_ips and b in best_ips else None  # noqa
    if {"omniroll", "flowgrpo", "bound"} <= set(best_ips):
        print(f"best-of-{args.repeats} figures: speed-up {best_ratio('omniroll', 'flowgrpo'):.2f}x, efficiency "
              f"{best_ratio('omniroll', 'bound'):.3f}")
    if inv_overhead is not None:
        print(f"batch-invariance overhead = {100 * inv_overhead:+.1f}% wall time (invariant vs non-invariant engine)")

    record_loadavg(info, "loadavg_end")
    record = {
        "benchmark": "rollout_throughput",
        "images": n_img, "prompts": args.prompts, "n": args.n, "steps": args.steps, "guidance": args.guidance,
        "window_size": args.window_size, "window_range": list(args.window_range), "height": args.height,
        "width": args.width, "max_sequence_length": args.max_sequence_length, "layers": args.layers,
        "flowgrpo_batch_size": args.batch_size, "engine_batch_rows": args.engine_batch, "repeats": args.repeats,
        "engine_rows_chosen": engine_rows, "bound_rows": best_rows, "bound_decode_batch": best_decode,
        "decode_s_per_image": {str(b): round(v, 4) for b, v in dsweep.items()}, "smoke": args.smoke,
        "images_per_s_omniroll": rnd(ips.get("omniroll")),
        "images_per_s_omniroll_noninvariant": rnd(ips.get("omniroll_noninvariant")),
        "images_per_s_flowgrpo": rnd(ips.get("flowgrpo")),
        "images_per_s_bound": rnd(ips.get("bound")),
        "speedup": rnd(speedup, 3),
        "speedup_noninvariant": rnd(ratio("omniroll_noninvariant", "flowgrpo"), 3),
        "efficiency": rnd(efficiency, 3),
        "efficiency_noninvariant": rnd(ratio("omniroll_noninvariant", "bound"), 3),
        "invariance_overhead": rnd(inv_overhead, 3),
        "speedup_best": rnd(best_ratio("omniroll", "flowgrpo"), 3),
        "speedup_cpu": rnd(cpu_ratio("omniroll", "flowgrpo"), 3),
        "efficiency_cpu": rnd(cpu_ratio("omniroll", "bound"), 3),
        "cpu_seconds": {k: [round(x["cpu_s"], 3) for x in v] for k, v in results.items()},
        "efficiency_best": rnd(best_ratio("omniroll", "bound"), 3),
        "invariance_overhead_best": rnd((best_s["omniroll"] / best_s["omniroll_noninvariant"] - 1)
                                        if {"omniroll", "omniroll_noninvariant"} <= set(best_s) else None, 3),
        "seconds": {k: [round(x["seconds"], 3) for x in v] for k, v in results.items()},
        "forward_ms_per_row": {m: {str(r): round(v, 2) for r, v in d.items()} for m, d in sweep.items()},
        "machine": info,
    }
    for eng in engines.values():
        eng.shutdown()
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
