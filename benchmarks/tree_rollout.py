"""Tree rollouts: transformer forwards and wall time per leaf of a tree (8 leaves over two levels) against independent
samples, in one run, with every leaf checked bitwise against its unshared run.

    .venv/bin/python benchmarks/tree_rollout.py            # standard: 1 prompt x 8, T=10, 32 px, 3 repeats (~1-2 min)
    .venv/bin/python benchmarks/tree_rollout.py --smoke    # 1 repeat

Each prompt's group is 8 samples, CFG 4.5, noise 0.7, sde type "sde", Flow-GRPO's window (every step but the last),
bench SD3 (`build_tiny_sd3` preset "bench"):

- independent: 8 samples of their own seeds (Flow-GRPO's rollout): every sample runs every step.
- tree [w1, w2]: the group is a tree forking at steps `--fork-steps` (3 and 6) into w1 then w2 children
  (`omniroll.engine.tree.tree_requests`); the engine runs each node's steps once (`omniroll.engine.prefix_tree`).
- unshared: the same leaf requests on an engine with `prefix_sharing=False`: what each leaf gives run alone.

`forwards_per_leaf`: forward rows per leaf of the tree over those of an independent sample (the worse of the two tree
shapes; goal <= 0.6); `seconds_per_leaf` and `cpu_per_leaf`: likewise for wall time and this process's CPU time
(medians over the repeats; on a small model fewer rows per forward cost more each, so time falls less than
forwards); `bitwise`: every leaf's
pixels, window latents, sigmas and fp32 log-probs equal its unshared run's, in every repeat. Contenders alternate
within one run in a rotated order. The last line is one JSON object.
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

TREES = {"tree_2x4": (2, 4), "tree_4x2": (4, 2)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny setting that runs in seconds (checks the script)")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fork-steps", type=int, nargs=2, default=(3, 6))
    ap.add_argument("--size", type=int, default=32, help="height = width in pixels")
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--max-sequence-length", type=int, default=16)
    ap.add_argument("--engine-batch", type=int, default=32, help="max_batch_size (forward rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=".omniroll_cache")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    return args


def requests_for(args, name: str, prompts: list[str], run: int):
    from omniroll.engine.params import GenerationRequest, SamplingParams
    from omniroll.engine.tree import TreeSpec, tree_requests
    from omniroll.sampling.seeds import derive_seed

    params = SamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps,
                            guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length,
                            noise_level=args.noise_level, sde_type="sde")
    out = []
    for i, p in enumerate(prompts):
        if name == "independent":
            out += [GenerationRequest(request_id=f"r{run}-p{i}-s{j}", prompt=p, sampling_params=params,
                                      seed=derive_seed(args.seed, run, f"p{i}", j)) for j in range(8)]
        else:
            tree = TreeSpec(fork_steps=tuple(args.fork_steps), widths=TREES[name])
            out += tree_requests(tree, params, seed=args.seed * 1_000_003 + run, id_prefix=f"r{run}-p{i}-{name}",
                                 prompt=p)
    return out


def rollout(engine, requests) -> dict:
    engine.call_between_steps(engine.prompt_cache.clear)  # a new rollout: nothing encoded yet (not timed)
    rows0 = engine.rows_run
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(requests)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0  # CPU seconds: less noisy on a shared machine
    assert all(o.stop_reason == "completed" for o in outs)
    return {"seconds": dt, "cpu_s": cpu, "samples": len(outs), "forward_rows": engine.rows_run - rows0,
            "outputs": outs}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_libraries(("diffusers", "transformers"))
    from omniroll.engine.engine import DiffusionEngine

    info = machine_info(args.threads)
    path = build_model(args.cache_dir, "bench")
    shared = DiffusionEngine.from_pretrained(path, max_batch_size=args.engine_batch)
    alone = DiffusionEngine.from_pretrained(path, max_batch_size=args.engine_batch, prefix_sharing=False)
    n = args.prompts * 8
    print(f"# tree rollouts: {args.prompts} prompts x 8 leaves, T={args.steps}, forks at {args.fork_steps}, CFG "
          f"{args.guidance}, {args.size}px, L={args.max_sequence_length}, fp32, {args.threads} threads, "
          f"{args.engine_batch} rows; {info['cpu']} x{info['cpu_count']}, load {info.get('loadavg_start')}",
          flush=True)
    contenders = ["independent"] + list(TREES)
    for name in contenders:  # warm-up (not timed)
        rollout(shared, requests_for(args, name, make_prompts(1, 0), 0))
    results = {k: [] for k in contenders + [f"{t}_unshared" for t in TREES]}
    bitwise = True
    for rep in range(args.repeats):
        prompts = make_prompts(args.prompts, rep + 1)
        for name in rotated(contenders, rep):
            reqs = requests_for(args, name, prompts, rep + 1)
            r = rollout(shared, reqs)
            results[name].append(r)
            line = f"  repeat {rep} {name:<12} {r['seconds']:7.2f}s  forward rows {r['forward_rows']}"
            if name in TREES:
                u = rollout(alone, reqs)
                results[f"{name}_unshared"].append(u)
                same = equal_outputs(r["outputs"], u["outputs"])
                bitwise &= same
                line += f"  (unshared {u['seconds']:.2f}s, {u['forward_rows']} rows; bitwise {same})"
            print(line, flush=True)

    def per_sample(name: str, key: str) -> float:
        return statistics.median(x[key] / x["samples"] for x in results[name])

    record = {"benchmark": "tree_rollout", "prompts": args.prompts, "leaves": 8, "samples": n, "steps": args.steps,
              "fork_steps": list(args.fork_steps), "size": args.size, "repeats": args.repeats, "smoke": args.smoke}
    print()
    print("| contender | forward rows / sample | vs independent | wall s / sample | vs independent | CPU s / sample "
          "| vs independent |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = {k: per_sample("independent", k) for k in ("forward_rows", "seconds", "cpu_s")}
    for name in results:
        rows, s, cpu = (per_sample(name, k) for k in ("forward_rows", "seconds", "cpu_s"))
        print(f"| {name} | {rows:.1f} | {rows / base['forward_rows']:.3f} | {s:.4f} | {s / base['seconds']:.3f} | "
              f"{cpu:.4f} | {cpu / base['cpu_s']:.3f} |")
        record[f"forwards_ratio_{name}"] = rnd(rows / base["forward_rows"], 4)
        record[f"seconds_ratio_{name}"] = rnd(s / base["seconds"], 4)
        record[f"cpu_ratio_{name}"] = rnd(cpu / base["cpu_s"], 4)
    record["forwards_per_leaf"] = max(record[f"forwards_ratio_{t}"] for t in TREES)
    record["seconds_per_leaf"] = max(record[f"seconds_ratio_{t}"] for t in TREES)
    record["cpu_per_leaf"] = max(record[f"cpu_ratio_{t}"] for t in TREES)
    record["bitwise"] = bitwise
    print(f"forwards per leaf vs an independent sample: {record['forwards_per_leaf']:.3f} (the worse tree; goal "
          f"<= 0.6), wall time per leaf {record['seconds_per_leaf']:.3f}, CPU time {record['cpu_per_leaf']:.3f}; "
          f"every leaf bitwise its unshared run: {bitwise}")
    record_loadavg(info, "loadavg_end")
    record["machine"] = info
    shared.shutdown()
    alone.shutdown()
    print(json.dumps(record), flush=True)
    return 0 if bitwise else 1


if __name__ == "__main__":
    sys.exit(main())
