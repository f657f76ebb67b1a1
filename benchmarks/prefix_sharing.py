"""Group prefix sharing: flow_grpo's loop with `same_latent` vs omniroll sharing a group's ODE prefix.

    .venv/bin/python benchmarks/prefix_sharing.py            # standard: 2 prompts x 8, T=10, 256 px, 3 repeats
    .venv/bin/python benchmarks/prefix_sharing.py --smoke    # seconds: 1 prompt x 4, 64 px, 1 repeat

Scenarios, each P prompts x n samples (n = 8), T = 10 steps, CFG 4.5, noise 0.7, sde type "sde", bench SD3:
(a) `same_latent`: SDE window of 2 steps drawn in (0, 5) (Flow-GRPO-Fast); (a, expected) `same_latent_expected`:
the same draw's expectation, measured exactly instead of sampled: one rollout at each of the 4 equally likely window
starts (windows (0, 2), (1, 3), (2, 4), (3, 5)), times summed (what sharing saves grows with the start, so a few
random draws make (a) a lottery: 2 prompts x 3 repeats are 6 draws); (b) a late window, steps 6-7 (MixGRPO-style:
window range (6, 8)). The samples of a prompt share their initial noise (and window):

- flowgrpo: a faithful reimplementation of flow_grpo's rollout loop (benchmarks/_flowgrpo_loop.py) with
  `same_latent` (per-image generators seeded from sha256(prompt)): every member recomputes the common prefix.
- omniroll: the engine with `latent_seed` per prompt group and prefix sharing on (the default): the prefix runs once
  per group and forks at the window's start.
- omniroll_noshare: the same engine and requests with `prefix_sharing=False` (what the mechanism alone buys).

`bitwise_equal`: every output of omniroll (pixels, window latents, log-probs) equals omniroll_noshare's, in every
repeat, i.e. sharing changes no sample. Contenders alternate within one run in a rotated order; medians are the
headline (best-of-repeats beside them; noise only adds time). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from _common import (build_model, equal_outputs, machine_info, make_prompts, quiet_libraries,  # noqa: E402
                     record_loadavg, rnd, rotated)
from _flowgrpo_loop import flowgrpo_rollout  # noqa: E402

#: scenario -> (window size, the window ranges of its rollouts: one rollout per range, times summed)
SCENARIOS = {"same_latent": (2, [(0, 5)]), "same_latent_expected": (2, [(0, 2), (1, 3), (2, 4), (3, 5)]),
             "late_window": (2, [(6, 8)])}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny setting that runs in seconds (checks the script)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=256, help="height = width in pixels")
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--max-sequence-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4, help="flow_grpo's fixed sampling batch (images)")
    ap.add_argument("--engine-batch", type=int, default=16, help="omniroll max_batch_size (forward rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=".omniroll_cache")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.size, args.repeats, args.max_sequence_length = 1, 4, 64, 1, 16
    if args.steps < 8:
        ap.error("--steps must be >= 8 (the late window is steps 6-7)")
    return args


def workload(args, name: str, rng: tuple[int, int]) -> argparse.Namespace:
    """The namespace flowgrpo_rollout reads, for one rollout of a scenario."""
    size = SCENARIOS[name][0]
    return argparse.Namespace(
        max_sequence_length=args.max_sequence_length, seed=args.seed, batch_size=args.batch_size, n=args.n,
        height=args.size, width=args.size, steps=args.steps, window_range=rng, window_size=size,
        noise_level=args.noise_level, guidance=args.guidance, same_latent=True)


def omniroll_rollout(engine, prompts: list[str], w: argparse.Namespace, run: int) -> dict:
    from omniroll.engine.params import GenerationRequest, SamplingParams

    requests = []
    for i, p in enumerate(prompts):
        params = SamplingParams(
            height=w.height, width=w.width, num_inference_steps=w.steps, guidance_scale=w.guidance,
            max_sequence_length=w.max_sequence_length, noise_level=w.noise_level, sde_type="sde",
            sde_window_size=w.window_size, sde_window_range=tuple(w.window_range), latent_seed=run * 1000 + i)
        requests += [GenerationRequest(request_id=f"r{run}-p{i}-s{j}", prompt=p, negative_prompt="",
                                       sampling_params=params, seed=run * 100_003 + i * w.n + j) for j in range(w.n)]
    engine.call_between_steps(engine.prompt_cache.clear)  # a new rollout: nothing encoded yet (not timed)
    saved0, rows0 = engine.stats()["prefix_steps_saved"], engine.rows_run
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    dt = time.perf_counter() - t0
    assert all(o.stop_reason == "completed" for o in outs)
    return {"seconds": dt, "images": len(outs), "outputs": outs, "forward_rows": engine.rows_run - rows0,
            "steps_saved": engine.stats()["prefix_steps_saved"] - saved0}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_libraries(("diffusers", "transformers"))
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import deprecation_utils

    from omniroll.engine.engine import DiffusionEngine

    info = machine_info(args.threads)
    path = build_model(args.cache_dir, "bench")
    engines = {"omniroll": DiffusionEngine.from_pretrained(path, max_batch_size=args.engine_batch),
               "omniroll_noshare": DiffusionEngine.from_pretrained(path, max_batch_size=args.engine_batch,
                                                                   prefix_sharing=False)}
    dtype_key = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    pipe = StableDiffusion3Pipeline.from_pretrained(path, local_files_only=True, **{dtype_key: torch.float32})
    pipe.set_progress_bar_config(disable=True)
    contenders = {
        "flowgrpo": lambda prompts, w, run: flowgrpo_rollout(pipe, prompts, w, run),
        "omniroll": lambda prompts, w, run: omniroll_rollout(engines["omniroll"], prompts, w, run),
        "omniroll_noshare": lambda prompts, w, run: omniroll_rollout(engines["omniroll_noshare"], prompts, w, run),
    }
    n_img = args.prompts * args.n
    print(f"# prefix sharing: {args.prompts} prompts x {args.n} samples = {n_img} images, T={args.steps}, CFG "
          f"{args.guidance}, {args.size}px, L={args.max_sequence_length}, fp32, {args.threads} threads; flow_grpo "
          f"batch {args.batch_size}, omniroll {args.engine_batch} rows; {info['cpu']} x{info['cpu_count']}, load "
          f"{info.get('loadavg_start')}", flush=True)

    results = {s: {k: [] for k in contenders} for s in SCENARIOS}
    bitwise, run = True, 0
    for s in SCENARIOS:  # warm-up: every contender, every scenario, one prompt (not timed)
        for name, fn in contenders.items():
            fn(make_prompts(1, 0), workload(args, s, SCENARIOS[s][1][0]), 0)
    for rep in range(args.repeats):
        for s in SCENARIOS:
            run += 1
            prompts = make_prompts(args.prompts, run)
            parts = {name: [] for name in contenders}
            # contenders alternate within each window range (adjacent runs of ~10 s), so a slow drift of the
            # machine's speed falls on all of them alike rather than on whichever ran a long stretch
            for k, rng in enumerate(SCENARIOS[s][1]):
                for name in rotated(list(contenders), rep + k):
                    c0 = time.process_time()
                    r = contenders[name](prompts, workload(args, s, rng), run)
                    r["cpu_s"] = time.process_time() - c0  # CPU seconds of this process: less noisy than wall time
                    parts[name].append(r)
            outs = {}
            for name in contenders:
                r = {k: sum(p[k] for p in parts[name]) for k in ("seconds", "images", "cpu_s", "forward_rows",
                                                                 "steps_saved") if k in parts[name][0]}
                r.setdefault("forward_rows", len(parts[name]) * n_img * args.steps * (2 if args.guidance > 1 else 1))
                outs[name] = [o for p in parts[name] for o in (p.get("outputs") or [])]
                results[s][name].append(r)
                saved = f"  prefix steps saved {r['steps_saved']}" if "steps_saved" in r else ""
                print(f"  repeat {rep} {s:<20} {name:<17} {r['seconds']:7.2f}s  cpu {r['cpu_s']:7.2f}s  forward rows "
                      f"{r['forward_rows']}{saved}", flush=True)
            bitwise &= equal_outputs(outs["omniroll"], outs["omniroll_noshare"])

    record = {"benchmark": "prefix_sharing", "images": n_img, "prompts": args.prompts, "n": args.n,
              "steps": args.steps, "size": args.size, "repeats": args.repeats, "smoke": args.smoke}
    print()
    print("| scenario | contender | median s | images/s | vs flow_grpo | best s | median CPU s | CPU vs flow_grpo | "
          "forward rows |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in SCENARIOS:
        med = {k: statistics.median(x["seconds"] for x in v) for k, v in results[s].items()}
        best = {k: min(x["seconds"] for x in v) for k, v in results[s].items()}
        cpu = {k: statistics.median(x["cpu_s"] for x in v) for k, v in results[s].items()}
        rows = {k: statistics.median(x["forward_rows"] for x in v) for k, v in results[s].items()}
        imgs = results[s]["flowgrpo"][0]["images"]
        for k in contenders:
            print(f"| {s} | {k} | {med[k]:.2f} | {imgs / med[k]:.3f} | {med['flowgrpo'] / med[k]:.2f}x | "
                  f"{best[k]:.2f} | {cpu[k]:.2f} | {cpu['flowgrpo'] / cpu[k]:.2f}x | {rows[k]:.0f} |")
        record[f"speedup_{s}_cpu"] = rnd(cpu["flowgrpo"] / cpu["omniroll"], 3)
        record[f"forward_rows_{s}"] = rows
        record[f"speedup_{s}"] = rnd(med["flowgrpo"] / med["omniroll"], 3)
        record[f"speedup_{s}_best"] = rnd(best["flowgrpo"] / best["omniroll"], 3)
        record[f"sharing_gain_{s}"] = rnd(med["omniroll_noshare"] / med["omniroll"], 3)
        record[f"seconds_{s}"] = {k: [round(x["seconds"], 3) for x in v] for k, v in results[s].items()}
    record["bitwise_equal"] = bitwise
    print(f"speed-up vs flow_grpo same_latent: (a) {record['speedup_same_latent']:.2f}x (goal >= 1.08; over the "
          f"window draw's expectation {record['speedup_same_latent_expected']:.2f}x), (b) late window "
          f"{record['speedup_late_window']:.2f}x (goal >= 1.5); sharing alone: "
          f"{record['sharing_gain_same_latent']:.2f}x / {record['sharing_gain_same_latent_expected']:.2f}x / "
          f"{record['sharing_gain_late_window']:.2f}x; bitwise equal to no sharing: {bitwise}")
    record_loadavg(info, "loadavg_end")
    record["machine"] = info
    for eng in engines.values():
        eng.shutdown()
    print(json.dumps(record), flush=True)
    return 0 if bitwise else 1


if __name__ == "__main__":
    sys.exit(main())
