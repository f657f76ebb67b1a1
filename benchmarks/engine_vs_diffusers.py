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
  engine, row threads (`rows`; at 2 threads and more): the same engine with `row_threads` = the thread count
              instead of intra-op threads: each step's rows split into that many forwards run at once, each on
              one torch thread (a sample's bits are the 1-thread engine's; checked here against it)
The prompt encodings are part of the work for both (the engine's prompt cache is cleared before every timed run).
Every contender runs once to warm up, then `--rounds` interleaved rounds (A B C ... A B C ...), at each thread count
(`torch.set_num_threads` for diffusers, the engine's `num_threads`; the count each contender runs at is set again
before each of its runs, as the row-thread engines run torch at one thread). Headline: the median of the rounds'
pictures/s, best beside it; the ratio is engine / diffusers. The machine may be shared: the load average at start
and end is recorded, and the CPU seconds this process spent per picture (all its threads; a measure of the work that
sharing disturbs less than wall time) are printed beside, with their ratio diffusers / engine. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from _common import (EngineContender, at_threads, equal_outputs, interleaved_rounds, machine_info,  # noqa: E402
                     print_versus, quiet_libraries, record_loadavg, seed_of)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "examples", "shapes_eval_train.txt")
ENGINES = [(inv, rows) for rows in (64, 128) for inv in (True, False)]
ROW_ENGINES = [(True, 64), (True, 128), (False, 128)]  # with row threads, at 2 threads and more
SAMPLING = dict(height=64, width=64, num_inference_steps=10, guidance_scale=4.5, max_sequence_length=12)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48, help="pictures per run (the prompt file's lines, cycled)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per thread count")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, one pass each")
    ap.add_argument("--smoke", action="store_true", help="4 pictures, 1 round, 1 and 2 threads: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.rounds, args.threads = 4, 1, [1, 2]
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
    engines = {(inv, rows, 1): EngineContender(path, prompts, SAMPLING, inv, rows, threads, shape)
               for inv, rows in ENGINES}
    if threads > 1:
        engines.update({(inv, rows, threads): EngineContender(path, prompts, SAMPLING, inv, rows, threads, shape,
                                                              row_threads=threads) for inv, rows in ROW_ENGINES})
    contenders = {"diffusers": at_threads(threads, pipe.run)}
    for (inv, rows, row_threads), eng in engines.items():
        for mode in ("ode", "sde"):
            name = f"{'inv' if inv else 'plain'}_{mode}{'_rows' if row_threads > 1 else ''}_{rows}"
            contenders[name] = at_threads(1 if row_threads > 1 else threads, lambda e=eng, m=mode: e.run(m))
    try:
        rounds_out = interleaved_rounds(contenders, rounds)
        if threads > 1:
            check_row_threads(path, prompts, shape, engines[(True, 64, threads)])
        return rounds_out
    finally:
        for eng in engines.values():
            eng.engine.shutdown()


def check_row_threads(path: str, prompts: list[str], shape: tuple, rows: EngineContender) -> None:
    """The row-thread engine drew the samples of an engine at 1 torch thread (made here), bitwise (batch-invariant,
    the SDE window)."""
    torch.set_num_threads(1)
    one = EngineContender(path, prompts, SAMPLING, True, 64, 1, shape)
    try:
        a, b = one.outputs("sde"), rows.outputs("sde")
    finally:
        one.engine.shutdown()
    if not equal_outputs(a, b):
        raise AssertionError("the row-thread engine's samples differ from the 1-thread engine's")
    print("# row threads: every sample bitwise the 1-thread engine's (batch-invariant, SDE window)", flush=True)


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
