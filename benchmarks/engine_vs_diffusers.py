"""The engine against diffusers' `StableDiffusion3Pipeline` on the shipped shapes model, the same work, one run.

    python benchmarks/engine_vs_diffusers.py [--prompts 48] [--rounds 3] [--threads 1 2]

Work, the same for every contender: `--prompts` pictures (the lines of examples/shapes_eval_train.txt, cycled), one
seed each, 10 steps, CFG 4.5 (two forward rows a picture a step), 64 x 64 px, the model's 12 T5 tokens, uint8
pixels out. Contenders:
  diffusers   `StableDiffusion3Pipeline.from_pretrained(<the same checkpoint directory>)` (its own
              FlowMatchEulerDiscreteScheduler), one call for every picture (one generator per picture)
  engine      `DiffusionEngine.from_pretrained(<the same directory>)`, `generate` of every picture at once:
              batch_invariant on (`inv`) and off (`plain`), at `max_batch_size` 64 (96 CFG rows: two forwards a step)
              and 128 (one), on the ODE (noise level 0, no log-probs) and with Flow-GRPO's SDE window (the shapes
              recipe's: 3 steps drawn in [0, 5], noise 0.8, log-probs recorded)
The prompt encodings are part of the work for both (the engine's prompt cache is cleared before every timed run).
Every contender runs once to warm up, then `--rounds` interleaved rounds (A B C ... A B C ...), at each thread count
(`torch.set_num_threads` for diffusers, the engine's `num_threads`). Headline: the median of the rounds' pictures/s,
best beside it; the ratio is engine / diffusers. The machine may be shared: the load average at start and end is
recorded, and the CPU seconds this process spent per picture (all its threads; a measure of the work that sharing
disturbs less than wall time) are printed beside, with their ratio diffusers / engine. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from _common import (EngineContender, interleaved_rounds, machine_info, print_versus,  # noqa: E402
                     quiet_libraries, record_loadavg, seed_of)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "examples", "shapes_eval_train.txt")
ENGINES = [(inv, rows) for rows in (64, 128) for inv in (True, False)]
SAMPLING = dict(height=64, width=64, num_inference_steps=10, guidance_scale=4.5, max_sequence_length=12)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48, help="pictures per run (the prompt file's lines, cycled)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per thread count")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, one pass each")
    ap.add_argument("--smoke", action="store_true", help="4 pictures, 1 round, 1 thread: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.rounds, args.threads = 4, 1, [1]
    if args.prompts < 1 or args.rounds < 1 or min(args.threads) < 1:
        ap.error("--prompts, --rounds and --threads must be >= 1")
    return args


def load_prompts(n: int) -> list[str]:
    with open(PROMPTS) as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return [lines[i % len(lines)] for i in range(n)]


class Diffusers:
    def __init__(self, path: str, prompts: list[str]):
        from diffusers import StableDiffusion3Pipeline

        self.pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.prompts = prompts

    def run(self) -> int:
        s = SAMPLING
        gens = [torch.Generator().manual_seed(seed_of(i)) for i in range(len(self.prompts))]
        out = self.pipe(prompt=self.prompts, negative_prompt=[""] * len(self.prompts), generator=gens,
                        output_type="pt", **s).images
        pixels = (out * 255.0).round().to(torch.uint8)
        assert pixels.shape == (len(self.prompts), 3, s["height"], s["width"])
        return len(self.prompts)


def one_pass(path: str, prompts: list[str], threads: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(pictures/s, CPU s per picture) per contender, one pair per round, at `threads` torch threads."""
    torch.set_num_threads(threads)
    pipe = Diffusers(path, prompts)
    shape = (3, SAMPLING["height"], SAMPLING["width"])
    engines = {(inv, rows): EngineContender(path, prompts, SAMPLING, inv, rows, threads, shape)
               for inv, rows in ENGINES}
    torch.set_num_threads(threads)  # the pipeline runs on this thread
    contenders = {"diffusers": pipe.run}
    for (inv, rows), eng in engines.items():
        for mode in ("ode", "sde"):
            contenders[f"{'inv' if inv else 'plain'}_{mode}_{rows}"] = (lambda e=eng, m=mode: e.run(m))
    try:
        return interleaved_rounds(contenders, rounds)
    finally:
        for eng in engines.values():
            eng.engine.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    from omniroll.models import resolve_model

    path = resolve_model("shapes")
    prompts = load_prompts(args.prompts)
    info = machine_info(args.threads[0])
    t_start = time.perf_counter()
    print(f"# engine vs diffusers, shapes model: {len(prompts)} pictures, 10 steps, CFG 4.5, 64 px, "
          f"{args.rounds} interleaved rounds; load average at start {info.get('loadavg_start')}", flush=True)
    result: dict = {}
    print("| threads | contender | pictures/s (median) | best | vs diffusers (median) | best vs best "
          "| CPU ms per picture (median) | vs diffusers (CPU) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        print_versus(one_pass(path, prompts, threads, args.rounds), result, rate_key="ips", rate_digits=3,
                     lead=f"{threads} | ", suffix=f"_{threads}t")
    record_loadavg(info, "loadavg_end")
    print(f"# load average at end {info.get('loadavg_end')}; {time.perf_counter() - t_start:.0f} s in all")
    result.update({"pictures": len(prompts), "rounds": args.rounds, "machine": info})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
