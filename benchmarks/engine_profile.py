"""Where the engine's time goes: cProfile of one engine run on the shipped shapes model, as shares of the run.

    python benchmarks/engine_profile.py [--mode sde|ode] [--plain] [--prompts 48] [--rows 64] [--threads 1]

The work is `engine_vs_diffusers.py`'s (the prompts of examples/shapes_eval_train.txt, 10 steps, CFG 4.5, 64 px; `sde`:
Flow-GRPO's window with log-probs). The engine's loop is driven on this thread (`DiffusionEngine.step` until no work
is left), so cProfile sees every call; the prompt cache is cleared first, as in the comparison. One untimed run warms
up, then one profiled run. Parts (cumulative time of the functions named):
  prompt encoding        `attach_encodings` (each unique prompt once, one at a time: engine/admission.py)
  transformer forward    the adapter's `velocity` (every forward row, CFG rows included)
  CFG rows and mix       `guided_velocity` less the forward (the uncond rows' concatenation, the per-row CFG mix)
  SDE step and log-prob  `sde_step` (the Euler step outside the window) and the step noise draws
  recording              `RequestState.advance` (the window's latents and log-probs)
  step batching          `ModelRunner.step` less the above (stacking the rows' inputs, splitting the results)
  scheduling             `DiffusionEngine.step` less everything else (admission, schedule, finish)
  VAE decode             `ModelRunner.decode` (blocks of `decode_batch_size`)
  output assembly        `build_output` (engine/output_assembly.py: one copy to the host, uint8 pixels, fields)
cProfile adds a cost per Python call, so the Python-heavy parts read larger than they are. Times are this
process's CPU time (`time.process_time`, every thread: run it at 1 thread), so other jobs on a shared machine slow the
run but do not move the shares. Then, without the profiler, the pieces of work both contenders do, timed the engine's
way and diffusers' way on the same inputs: the transformer forwards (the engine's in its execution mode, in forwards
of `max_batch_size` rows; diffusers' one forward of every CFG row), the VAE decode (the engine's blocks; diffusers'
one call), the prompt encoding (the engine's unique prompts one at a time; diffusers' batched call with its
negatives). Prints the two tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time

from _common import ENGINE_MODES, machine_info, quiet_libraries, rnd, seed_of  # noqa: E402
from engine_vs_diffusers import SAMPLING, load_prompts  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["sde", "ode"], default="sde")
    ap.add_argument("--plain", action="store_true", help="batch_invariant off (default: on)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--rows", type=int, default=64, help="max_batch_size")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.rows < 2 or args.threads < 1:
        ap.error("--prompts and --threads must be >= 1, --rows >= 2")
    return args


def run_once(engine, prompts: list[str], params, tag: str) -> list:
    """Every prompt's request through the engine's loop, driven on this thread."""
    from omniroll.engine.admission import accept
    from omniroll.engine.params import GenerationRequest

    engine.prompt_cache.clear()
    requests = [GenerationRequest(request_id=f"{tag}-{i}", prompt=p, negative_prompt="", seed=seed_of(i),
                                  sampling_params=params) for i, p in enumerate(prompts)]
    futures, states = accept(engine.adapter, engine.config, engine.runner.device, requests, engine.inbox.release)
    for s in states:
        engine.scheduler.add(s)
    while engine.scheduler.has_work():
        engine.step()
    engine.completion.deliver([], engine.steps_run, flush=True)
    return [f.result() for f in futures]


def cumulative(stats: pstats.Stats, name: str, path_part: str) -> float:
    """The cumulative seconds of function `name` defined in a file whose path contains `path_part`."""
    best = 0.0
    for (path, _, func), (_, _, _, cum, _) in stats.stats.items():
        if func == name and path_part in path.replace(os.sep, "/"):
            best = max(best, cum)
    return best


def shares(stats: pstats.Stats) -> dict[str, float]:
    c = lambda name, part: cumulative(stats, name, part)  # noqa: E731
    forward = c("velocity", "omniroll/models/")
    guided = c("guided_velocity", "omniroll/models/")
    sde = c("sde_step", "omniroll/sampling/sde") + c("draw_step_noise", "omniroll/engine/request")
    record = c("advance", "omniroll/engine/request")
    runner_step = c("step", "omniroll/engine/runner")
    engine_step = c("step", "omniroll/engine/engine")
    encode = c("attach_encodings", "omniroll/engine/admission")
    decode = c("decode", "omniroll/engine/runner")
    output = c("build_output", "omniroll/engine/output_assembly")
    parts = {"prompt encoding": encode, "transformer forward": forward, "CFG rows and mix": guided - forward,
             "SDE step and log-prob": sde, "recording": record,
             "step batching": runner_step - guided - sde - record}
    parts["VAE decode"] = decode
    parts["output assembly"] = output
    parts["scheduling"] = engine_step - sum(parts.values())
    return parts


def cpu_seconds(fn, repeats: int = 3) -> float:
    """The least CPU time of `repeats` calls of `fn` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def components(engine, prompts: list[str]) -> list[tuple[str, float, float]]:
    """The work both contenders of `engine_vs_diffusers.py` do, timed piece by piece the engine's way and
    diffusers': (what, engine CPU s, diffusers CPU s) for the whole rollout of `prompts` (CFG, 10 steps)."""
    import torch

    from omniroll.engine.execution import execution_mode
    from omniroll.models.base import stack_conditioning

    adapter, config = engine.adapter, engine.config
    n, rows, block = len(prompts), 2 * len(prompts), config.decode_batch_size
    conds = adapter.encode_prompts(list(dict.fromkeys(prompts)) + [""], SAMPLING["max_sequence_length"])
    shape = adapter.latent_shape(SAMPLING["height"], SAMPLING["width"])
    mode = lambda: execution_mode(engine.runner.execution_info())  # noqa: E731

    def forward(batch: int, inside_mode: bool):
        cond = stack_conditioning([conds[i % len(conds)] for i in range(batch)])
        x, t = torch.randn(batch, *shape), torch.full((batch,), 500.0)

        def go():
            with mode() if inside_mode else contextlib.nullcontext(), torch.no_grad():
                adapter.velocity(x, t, cond)
        return go

    chunks = [min(config.max_batch_size, rows - i) for i in range(0, rows, config.max_batch_size)]
    engine_fwd = 10 * sum(cpu_seconds(forward(c, True)) for c in chunks)
    pipe_fwd = 10 * cpu_seconds(forward(rows, False))
    latents = torch.randn(n, *shape)

    def engine_decode():  # as the engine's completion calls it (the block size, not the mode, pins its bits)
        engine.runner.decode(latents)

    def pipe_decode():
        with torch.no_grad():
            adapter.decode(latents)

    def engine_encode():
        adapter.encode_prompts(list(dict.fromkeys(prompts)) + [""], SAMPLING["max_sequence_length"])

    def pipe_encode():
        with torch.no_grad():
            adapter.pipeline.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=adapter.device,
                                           do_classifier_free_guidance=True, negative_prompt=[""] * n,
                                           max_sequence_length=SAMPLING["max_sequence_length"])
    return [(f"transformer forwards ({rows} rows x 10 steps; engine: forwards of {chunks})", engine_fwd, pipe_fwd),
            (f"VAE decode of {n} (engine: blocks of {block})", cpu_seconds(engine_decode), cpu_seconds(pipe_decode)),
            (f"prompt encoding (engine: {len(conds)} unique, one at a time; diffusers: {n} + {n} negatives batched)",
             cpu_seconds(engine_encode), cpu_seconds(pipe_encode))]


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.engine.params import SamplingParams
    from omniroll.models import resolve_model

    info = machine_info(args.threads)
    engine = DiffusionEngine.from_pretrained(resolve_model("shapes"), max_batch_size=args.rows,
                                             batch_invariant=not args.plain, num_threads=args.threads)
    params = SamplingParams(**SAMPLING, **ENGINE_MODES[args.mode])
    prompts = load_prompts(args.prompts)
    run_once(engine, prompts, params, "warm")
    steps_before = engine.steps_run
    profile = cProfile.Profile(time.process_time)  # CPU time: a shared machine's other jobs do not count
    t0 = time.process_time()
    profile.enable()
    run_once(engine, prompts, params, "profiled")
    profile.disable()
    total = time.process_time() - t0
    steps = engine.steps_run - steps_before
    parts = shares(pstats.Stats(profile))
    print(f"# {len(prompts)} pictures, {args.mode}, batch_invariant={not args.plain}, max_batch_size={args.rows}, "
          f"{args.threads} thread(s): {steps} steps, {total:.2f} CPU s profiled; "
          f"load average at start {info.get('loadavg_start')}")
    print("| part | CPU s | share |")
    print("|---|---:|---:|")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds:.3f} | {100 * seconds / total:.1f} % |")
    print("\n| the same work, piece by piece | engine CPU s | diffusers CPU s | engine / diffusers |")
    print("|---|---:|---:|---:|")
    pieces = components(engine, prompts)
    for what, mine, theirs in pieces:
        print(f"| {what} | {mine:.3f} | {theirs:.3f} | {mine / theirs:.2f} |")
    engine.shutdown()
    print(json.dumps({"seconds": rnd(total, 3), "steps": steps,
                      "shares": {k: rnd(v / total, 4) for k, v in parts.items()},
                      "pieces": {what.split(" (")[0]: [rnd(a, 4), rnd(b, 4)] for what, a, b in pieces},
                      "machine": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
