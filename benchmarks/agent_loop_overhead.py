"""Agent-loop overhead: the full rollout stack (Ray replica + AgentLoopManager + reward workers) vs the engine alone.

    .venv/bin/python benchmarks/agent_loop_overhead.py [--prompts 16] [--n 4] [--steps 8] [--repeats 3]
        [--height 384 --width 384] [--preset tiny] [--reward-latency 0.4] [--agent-workers 2] [--reward-workers 1]

Every path does the same work: P prompts x n samples (default 16 x 4 = 64), T steps (default 8), CFG 4.5 (two
forward rows per image per step), an SDE window of `--window-size` steps drawn in `--window-range` (eta 0.7, "sde"),
fp32 log-probs over the window, one VAE decode per image, uint8 pixels, the tiny SD3 (built once into `--cache-dir`),
engine `max_batch_size` `--engine-batch` rows, batch-invariant mode (the engine default). The requests of (a) carry
exactly the prompts, sampling params and seeds (`derive_seed(rollout_seed, global_steps, uid, index)`) that the agent
loop sends in (b), and the images and log-probs of (a) and (b) are checked to be bitwise equal (untimed).

(a)  engine direct: one `DiffusionEngine` in this process, `engine.generate(all requests)`; `--threads` torch threads.
(b)  agent loop: 1 `RolloutReplica` Ray actor (same engine settings) holding all `--threads` CPUs of the Ray cluster
     (`ray.init(num_cpus=--threads)`; on a 2-core machine one replica with both cores is the fair comparison to (a),
     two 1-core replicas would halve each engine's torch threads), + `AgentLoopManager` with `--agent-workers`
     DiffusionAgentLoopWorker actors (num_cpus=0), via `manager.generate_sequences(DataBatch)`; the clock stops when
     the driver holds the merged output batch (every trajectory tensor stacked).
(b') as (b) plus streaming rewards: `--reward-workers` RewardLoopWorker actors (micro-batching, config defaults)
     with the reward config `{"fn": "http", "kwargs": {"url": ...}}` scoring every finished sample against a local
     FastAPI + uvicorn server (a thread of this process, 127.0.0.1) whose only cost is waiting:
     `await asyncio.sleep(--reward-latency)` per batch request.

The driver is idle during (b)/(b'): its engine thread waits on a condition variable, the main thread waits on Ray
futures; its CPU seconds during every run are measured and printed (as are those of the replica, the agent-loop
workers, the reward workers and the rest of Ray) so this can be checked. Start-up (model loads, Ray and actor start,
the HTTP server) is timed and reported separately; then every path is warmed up once (`--warmup-samples` samples,
fresh prompts) and the three paths run alternately, `--repeats` times, in a rotated order. Every run uses prompts no
engine has seen (the prompt-encode cache never hits across runs; (a) and (b) of one repeat share prompts, in two
different engines). Medians are reported (the machine may be shared). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import torch  # noqa: E402
from _agent_paths import rows_for, run_agent_loop, run_engine  # noqa: E402
from _common import (add_run_args, add_workload_args, build_model, machine_info, make_prompts,  # noqa: E402
                     quiet_libraries, record_loadavg, rnd, rotated)
from _cpu_meter import CpuMeter  # noqa: E402
from _reward_server import RewardServer, encode_costs  # noqa: E402

PATHS = ("engine", "agent_loop", "agent_loop_reward")
LABELS = {"engine": "(a)  engine direct", "agent_loop": "(b)  agent loop, no reward",
          "agent_loop_reward": "(b') agent loop + HTTP reward"}


# --------------------------------------------------------------------------------------------------- setup
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, prompts=16, steps=8, size=384, prompts_help="unique prompts P per run")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "bench"], help="build_tiny_sd3 preset")
    ap.add_argument("--engine-batch", type=int, default=16, help="engine max_batch_size (forward rows)")
    add_run_args(ap, threads=min(2, os.cpu_count() or 1), seed_help="rollout seed",
                 threads_help="torch threads of (a) = CPUs of the Ray cluster = num_cpus of the replica")
    ap.add_argument("--agent-workers", type=int, default=2, help="agent.num_workers (DiffusionAgentLoopWorker actors)")
    ap.add_argument("--reward-workers", type=int, default=1, help="reward.num_workers (RewardLoopWorker actors)")
    ap.add_argument("--reward-latency", type=float, default=0.4,
                    help="seconds the reward server waits per batch request")
    ap.add_argument("--warmup-samples", type=int, default=16, help="samples of each path's warm-up run")
    ap.add_argument("--settle", type=float, default=0.5, help="idle seconds before every timed run (untimed)")
    ap.add_argument("--skip-reward", action="store_true", help="leave out (b')")
    ap.add_argument("--reward-encoding", default="png", choices=["png", "safetensors"],
                    help="HttpScorer request body (png: JSON with base64 PNG, the default; safetensors: raw uint8)")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.n < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--prompts, --n, --repeats and --threads must be >= 1")
    if args.warmup_samples < 1:
        ap.error("--warmup-samples must be >= 1")
    return args


def build_config(args, model_path: str, reward_url: str):
    from omniroll.config import load_config

    return load_config({
        "replicas": {"count": 1, "num_cpus": args.threads},
        "engine": {"model": model_path, "max_batch_size": args.engine_batch},
        "pipeline": {"height": args.height, "width": args.width, "num_inference_steps": args.steps,
                     "guidance_scale": args.guidance, "max_sequence_length": args.max_sequence_length},
        "algo": {"noise_level": args.noise_level, "sde_type": "sde", "sde_window_size": args.window_size,
                 "sde_window_range": list(args.window_range)},
        "agent": {"num_workers": args.agent_workers},
        "reward": {"num_workers": args.reward_workers,
                   "functions": {"http": {"fn": "http", "kwargs": {"url": reward_url,
                                                                      "encoding": args.reward_encoding}}}},
        "n": args.n, "seed": args.seed, "calculate_log_probs": True,
    })


# --------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_libraries(("diffusers", "transformers", "httpx", "uvicorn"))
    import ray

    from omniroll.agent_loop.cluster import RolloutCluster
    from omniroll.agent_loop.manager import AgentLoopManager
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.rollout.replica import resolve_engine_kwargs

    startup: dict[str, float] = {}

    def timed(key, fn):
        t0 = time.perf_counter()
        r = fn()
        startup[key] = time.perf_counter() - t0
        return r

    info = machine_info(args.threads, extra_modules=("ray",))
    path = timed("build_model", lambda: build_model(args.cache_dir, args.preset))
    server = timed("reward_server", lambda: RewardServer(args.reward_latency))
    cfg = build_config(args, path, server.url)
    timed("ray_init", lambda: ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False,
                                       configure_logging=False))
    # the replica's own conversion of engine_kwargs (dtype string -> torch dtype): identical engine settings
    engine_kwargs = resolve_engine_kwargs(cfg.engine.engine_kwargs())
    engine = timed("engine_load", lambda: DiffusionEngine.from_pretrained(path, **engine_kwargs))
    eng_threads = engine.call_between_steps(torch.get_num_threads)
    # the replica and the reward workers as every command starts them (RolloutCluster, attached to the Ray above)
    cluster = RolloutCluster(cfg, with_rewards=not args.skip_reward, with_manager=False, log=None)
    managers = {}
    try:
        timed("replica_and_reward_workers_start", cluster.start)
        replicas, reward_handles = cluster.replicas, cluster.reward_workers
        replica = replicas[0]
        rep_threads = ray.get(replica.__ray_call__.remote(
            lambda self: self.engine.call_between_steps(torch.get_num_threads)))
        if eng_threads != args.threads or rep_threads != args.threads:
            raise RuntimeError(f"torch threads: engine (a) {eng_threads}, replica {rep_threads}, wanted "
                               f"{args.threads} (is OMP_NUM_THREADS set in the environment?)")
        roles = {ray.get(replica.health.remote())["pid"]: "replica"}

        def start_managers():
            managers["agent_loop"] = AgentLoopManager(cfg, replicas, None)
            if not args.skip_reward:
                for pid in ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in reward_handles]):
                    roles[pid] = "reward workers"
                managers["agent_loop_reward"] = AgentLoopManager(cfg, replicas, reward_handles)
            for m in managers.values():  # actors start lazily: wait until every worker answers
                for pid in ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in m.workers]):
                    roles[pid] = "agent-loop workers"

        timed("agent_workers_start", start_managers)
        meter = CpuMeter(roles)
        paths = [p for p in PATHS if p == "engine" or p in managers]
        tags = {"engine": 0, "agent_loop": 0, "agent_loop_reward": 1}  # (a) and (b) share prompts, in 2 engines

        def run_path(name: str, run: int, n_samples: int) -> dict:
            P = max(1, -(-n_samples // args.n))
            rows = rows_for(make_prompts(P, run, tags[name], tags_per_run=3), args.n, run)[:n_samples]
            gc.collect()
            time.sleep(args.settle)
            c0, cpu0 = time.process_time(), meter.snapshot()
            if name == "engine":
                r = run_engine(engine, rows, cfg, run, args)
            else:
                r = run_agent_loop(managers[name], replica, rows, run, args,
                                   server if name == "agent_loop_reward" else None)
            r["cpu"] = meter.delta(cpu0, meter.snapshot())
            r["driver_cpu_process_time"] = time.process_time() - c0
            return r

        S = args.prompts * args.n
        print(f"# agent-loop overhead: {args.prompts} prompts x {args.n} = {S} samples, T={args.steps}, CFG "
              f"{args.guidance}, SDE window {args.window_size} in {tuple(args.window_range)} (eta {args.noise_level}),"
              f" {args.height}x{args.width}, L={args.max_sequence_length}, '{args.preset}' SD3, fp32, engine "
              f"max_batch_size {args.engine_batch} rows, batch-invariant", flush=True)
        print(f"# (a) {args.threads} torch threads in this process; (b) 1 replica actor with num_cpus={args.threads} "
              f"(= every CPU of the Ray cluster; engine thread uses {rep_threads} torch threads), "
              f"{args.agent_workers} agent-loop worker(s), {args.reward_workers} reward worker(s), reward latency "
              f"{args.reward_latency}s/batch; machine: {info['cpu']} x{info['cpu_count']}, load "
              f"{info.get('loadavg_start')}", flush=True)
        print("# start-up (s, not in any timing): " + ", ".join(f"{k} {v:.2f}" for k, v in startup.items()),
              flush=True)

        for name in paths:  # warm-up, run index 0
            r = run_path(name, 0, args.warmup_samples)
            print(f"  warm-up  {LABELS[name]:<30} {r['seconds']:7.2f}s ({args.warmup_samples} samples)", flush=True)

        results: dict[str, list[dict]] = {p: [] for p in paths}
        equal: list[dict] = []
        for rep in range(args.repeats):
            run = rep + 1
            order = rotated(paths, rep)
            rr = {}
            for name in order:
                r = run_path(name, run, S)
                rr[name] = r
                extra = ""
                if "head" in r:
                    extra = f"  head {r['head']:.2f} span {r['span']:.2f} tail {r['tail']:.2f}"
                if "reward_requests" in r:
                    extra += (f"  reward: {r['reward_requests']} req, after last sample "
                              f"{r['reward_after_last_sample']:.2f}s")
                print(f"  repeat {rep} {LABELS[name]:<30} {r['seconds']:7.2f}s  {r['forwards']} fwd, "
                      f"driver cpu {r['cpu'].get('driver', 0):.2f}s{extra}", flush=True)
            a, b = rr["engine"], rr.get("agent_loop")
            # same prompts, seeds and params: batch-invariant engines should agree bitwise (reported, not fatal)
            equal.append({"responses": bool(torch.equal(a["responses"], b["responses"])),
                          "log_probs": bool(torch.equal(a["log_probs"], b["log_probs"])),
                          "max_abs_pixel_diff": int((a["responses"].int() - b["responses"].int()).abs().max()),
                          "max_abs_log_prob_diff": float((a["log_probs"] - b["log_probs"]).abs().max())})
            if not (equal[-1]["responses"] and equal[-1]["log_probs"]):
                print(f"  WARNING repeat {rep}: (a) and (b) outputs differ: {equal[-1]}", flush=True)
            last_images = a["responses"]
            for name, r in rr.items():
                del r["responses"], r["log_probs"]
                results[name].append(r)
    finally:
        for m in managers.values():
            m.shutdown()
        cluster.close()  # reward workers, replica (Ray stays: this script started it)
        engine.shutdown()
        server.close()

    # ------------------------------------------------------------------------------------------- report
    enc = encode_costs(last_images)
    print(f"# (a) vs (b) outputs (same prompts, seeds, params): "
          f"{'bitwise equal in every repeat' if all(e['responses'] and e['log_probs'] for e in equal) else equal}")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    secs = {p: [r["seconds"] for r in results[p]] for p in paths}
    m = {p: med(v) for p, v in secs.items()}
    S = args.prompts * args.n
    overhead = m["agent_loop"] / m["engine"] - 1
    paired_overhead = med([b / a - 1 for a, b in zip(secs["engine"], secs["agent_loop"])])
    e2e_gen = e2e_eng = paired_e2e = None
    if "agent_loop_reward" in m:
        e2e_gen = m["agent_loop_reward"] / m["agent_loop"]
        e2e_eng = m["agent_loop_reward"] / m["engine"]
        paired_e2e = med([c / b for b, c in zip(secs["agent_loop"], secs["agent_loop_reward"])])

    print()
    print("| path                           | median s | runs (s)              | img/s | vs (a)  | forwards | rows/fwd |")  # noqa: E501
    print("|--------------------------------|---------:|-----------------------|------:|--------:|---------:|---------:|")  # noqa: E501
    for p in paths:
        fw = med([r["forwards"] for r in results[p]])
        rows = med([r["rows"] / max(r["forwards"], 1) for r in results[p]])
        runs = " ".join(f"{x:.2f}" for x in secs[p])
        print(f"| {LABELS[p]:<30} | {m[p]:8.2f} | {runs:<21} | {S / m[p]:5.2f} | "
              f"{100 * (m[p] / m['engine'] - 1):+6.1f}% | {fw:8.0f} | {rows:8.2f} |")
    print()
    roles = sorted({k for p in paths for r in results[p] for k in r["cpu"]},
                   key=lambda k: ["driver", "replica", "agent-loop workers", "reward workers", "ray other"].index(k)
                   if k in ("driver", "replica", "agent-loop workers", "reward workers", "ray other") else 9)
    print("| CPU s per run (median)         | " + " | ".join(f"{k:>18}" for k in roles) + " |")
    print("|--------------------------------|" + "|".join("-" * 19 + ":" for _ in roles) + "|")
    for p in paths:
        print(f"| {LABELS[p]:<30} | " + " | ".join(f"{med([r['cpu'].get(k, 0.0) for r in results[p]]):18.2f}"
                                                   for k in roles) + " |")
    print()
    for p in paths[1:]:
        h, s, t = (med([r[k] for r in results[p]]) for k in ("head", "span", "tail"))
        print(f"# {LABELS[p].strip()}: head {h:.3f}s (call -> first request sent), generation span {s:.2f}s, "
              f"tail {t:.3f}s (last sample back in its worker -> merged batch in the driver)")
    if "agent_loop_reward" in results:
        rs = results["agent_loop_reward"]
        nreq = med([r["reward_requests"] for r in rs])
        sizes = [x for r in rs for x in r["reward_batch_sizes"]]
        wait = med([r["reward_wait"] for r in rs])
        print(f"# reward server: {nreq:.0f} batch requests per run (mean batch {statistics.mean(sizes):.1f} images), "
              f"total reward wait {wait:.2f}s per run = {100 * wait / m['agent_loop']:.0f}% of the generation-only "
              f"time; last reward done {med([r['reward_after_last_sample'] for r in rs]):.2f}s after the last sample "
              f"(latency {args.reward_latency}s); first scoring began "
              f"{med([r['first_reward_started_before_last_sample'] for r in rs]):.2f}s before the last sample")
        print(f"# total reward wait {'<=' if wait <= m['agent_loop'] else 'EXCEEDS'} the generation-only time "
              f"(the default latency is chosen so that it stays below)")
    min_fwd = -(-S * (2 if args.guidance > 1 else 1) * args.steps // args.engine_batch)
    print(f"# forwards: minimum for this work {min_fwd} (every forward full); engine-direct "
          f"{med([r['forwards'] for r in results['engine']]):.0f}, agent loop "
          f"{med([r['forwards'] for r in results['agent_loop']]):.0f}")
    print(f"# reward request body, built from this run's images: png {enc['png']['ms_per_image']:.2f} ms and "
          f"{enc['png']['kb_per_image']:.0f} kB per image (HttpScorer default), safetensors "
          f"{enc['safetensors']['ms_per_image']:.2f} ms and {enc['safetensors']['kb_per_image']:.0f} kB per image")
    print(f"overhead (b)/(a) - 1 = {100 * overhead:+.2f}% (median of paired per-repeat ratios "
          f"{100 * paired_overhead:+.2f}%)"
          f"; target <= +5%")
    if e2e_gen is not None:
        print(f"end-to-end with reward / generation only = (b')/(b) = {e2e_gen:.3f}x (paired {paired_e2e:.3f}x); "
              f"(b')/(a) = {e2e_eng:.3f}x; target <= 1.05x")

    record_loadavg(info, "loadavg_end")
    record = {
        "benchmark": "agent_loop_overhead",
        "samples": S, "prompts": args.prompts, "n": args.n, "steps": args.steps, "guidance": args.guidance,
        "window_size": args.window_size, "window_range": list(args.window_range), "height": args.height,
        "width": args.width, "preset": args.preset, "engine_batch_rows": args.engine_batch,
        "replicas": 1, "replica_num_cpus": args.threads, "agent_workers": args.agent_workers,
        "reward_workers": args.reward_workers if not args.skip_reward else 0, "reward_latency_s": args.reward_latency,
        "reward_encoding": args.reward_encoding,
        "repeats": args.repeats,
        "overhead_no_reward": rnd(overhead), "overhead_no_reward_paired": rnd(paired_overhead),
        "e2e_with_reward_over_generation": rnd(e2e_gen), "e2e_with_reward_over_generation_paired": rnd(paired_e2e),
        "e2e_with_reward_over_engine": rnd(e2e_eng),
        "seconds_engine": rnd(m["engine"], 3), "seconds_agent_loop": rnd(m["agent_loop"], 3),
        "seconds_agent_loop_reward": rnd(m.get("agent_loop_reward"), 3),
        "seconds_runs": {p: [round(x, 3) for x in v] for p, v in secs.items()},
        "phases_agent_loop": {p: {k: round(med([r[k] for r in results[p]]), 3) for k in ("head", "span", "tail")}
                              for p in paths[1:]},
        "forwards": {p: [r["forwards"] for r in results[p]] for p in paths},
        "cpu_seconds_median": {p: {k: round(med([r["cpu"].get(k, 0.0) for r in results[p]]), 3) for k in roles}
                               for p in paths},
        "reward_requests_per_run": [r["reward_requests"] for r in results.get("agent_loop_reward", [])],
        "reward_wait_s_per_run": [r["reward_wait"] for r in results.get("agent_loop_reward", [])],
        "min_forwards": min_fwd,
        "reward_encode": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in enc.items()},
        "startup_s": {k: round(v, 3) for k, v in startup.items()},
        "bitwise_equal_a_b": all(e["responses"] and e["log_probs"] for e in equal), "a_vs_b_outputs": equal,
        "machine": info,
    }
    ray.shutdown()
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
