"""The engine against diffusers' `WanPipeline` on a shapes-video checkpoint, the same work, one run.

    python benchmarks/wan_vs_diffusers.py --toy                      # a toy checkpoint made first (about a minute)
    python benchmarks/wan_vs_diffusers.py --model out/shapes-video-model/checkpoint [--clips 8] [--rounds 3]
    python benchmarks/wan_vs_diffusers.py                            # --model shapes-video (once it ships)

Work, the same for every contender: `--clips` clips (the moving-shapes world's training prompts, cycled), one seed
each, at the checkpoint's own sampling defaults (`omniroll_defaults.json`: 9 frames of 64 x 64 px, 10 steps, CFG
4.5, 12 tokens: two forward rows a clip a step), uint8 frames out. Contenders:
  diffusers   `WanPipeline.from_pretrained(<the checkpoint directory>)` (its own scheduler), one call for every clip
              (one generator per clip)
  engine      `DiffusionEngine.from_pretrained(<the same directory>)`, `generate` of every clip at once, every CFG row
              in one forward (`max_batch_size` 2 x clips): batch_invariant on (`inv`) and off (`plain`) on the ODE
              (noise level 0, no log-probs), and `inv_sde` with Flow-GRPO's SDE window (3 steps drawn in [0, 5],
              noise 0.8, log-probs recorded)
  engine, row threads (at `--threads` 2 and more): `inv_ode_rows` and `inv_sde_rows`, the same engine with
              `row_threads` = the thread count instead of intra-op threads (each step's rows split into that many
              forwards at once, each on one torch thread; a clip's bits are a 1-thread engine's)
The prompt encodings are part of the work for both (the engine's prompt cache is cleared before every timed run).
Every contender runs once to warm up, then `--rounds` interleaved rounds (A B C ... A B C ...) at `--threads` torch
threads (default 1). Headline: the median of the rounds' clips/s, best beside it; the ratio is engine / diffusers.
The CPU seconds this process spent per clip (all its threads) are printed beside, with their ratio diffusers /
engine (the machine may be shared: the load average at start and end is recorded). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from _common import (EngineContender, at_threads, interleaved_rounds, machine_info, print_versus,  # noqa: E402
                     quiet_libraries, record_loadavg, seed_of)

ENGINES = (("inv", True, "ode"), ("plain", False, "ode"), ("inv", True, "sde"))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shapes-video", help="a shapes-video checkpoint directory, or shapes-video "
                                                              "(the shipped one)")
    ap.add_argument("--toy", action="store_true", help="make a toy checkpoint (`omniroll pretrain shapes-video "
                                                      "--toy`) in a temporary directory and use it")
    ap.add_argument("--clips", type=int, default=8, help="clips per run (the training prompts, cycled)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    if args.clips < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--clips, --rounds and --threads must be >= 1")
    return args


def checkpoint(args, scratch: str) -> str:
    from omniroll.models import resolve_model

    if not args.toy:
        return resolve_model(args.model)
    from omniroll.models.shapes_video.pretrain import pretrain
    from omniroll.models.shapes_video.recipe import TOY

    return pretrain(TOY, scratch, progress=False, log=lambda _: None)["checkpoint"]


class Diffusers:
    def __init__(self, path: str, prompts: list[str], sampling: dict):
        from diffusers import WanPipeline

        self.pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.prompts, self.sampling = prompts, sampling

    def run(self) -> int:
        s, n = self.sampling, len(self.prompts)
        gens = [torch.Generator().manual_seed(seed_of(i)) for i in range(n)]
        video = self.pipe(prompt=self.prompts, negative_prompt=[""] * n, generator=gens, output_type="pt",
                          height=s["height"], width=s["width"], num_frames=s["num_frames"],
                          num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
                          max_sequence_length=s["max_sequence_length"]).frames
        frames = (video * 255.0).round().to(torch.uint8)
        assert frames.shape == (n, s["num_frames"], 3, s["height"], s["width"]), frames.shape
        return n


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    from omniroll.models import sampling_defaults
    from omniroll.tasks.moving_shapes.splits import split_prompts

    with tempfile.TemporaryDirectory(prefix="wan-vs-diffusers-") as scratch:
        path = checkpoint(args, scratch)
        defaults = sampling_defaults(path).get("pipeline", {})
        sampling = {k: defaults[k] for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
                                             "max_sequence_length")}
        train = split_prompts("train")
        prompts = [train[(7 * i) % len(train)] for i in range(args.clips)]  # spread over the categories
        info = machine_info(args.threads)
        t_start = time.perf_counter()
        print(f"# engine vs diffusers' WanPipeline, {path}: {len(prompts)} clips of {sampling['num_frames']} frames, "
              f"{sampling['height']} px, {sampling['num_inference_steps']} steps, CFG {sampling['guidance_scale']:g}, "
              f"{args.threads} thread(s), {args.rounds} interleaved rounds; load average at start "
              f"{info.get('loadavg_start')}", flush=True)
        torch.set_num_threads(args.threads)
        pipe = Diffusers(path, prompts, sampling)
        shape = (sampling["num_frames"], 3, sampling["height"], sampling["width"])
        engines = {inv: EngineContender(path, prompts, sampling, inv, 2 * len(prompts), args.threads, shape)
                   for inv in (True, False)}
        if args.threads > 1:
            engines["rows"] = EngineContender(path, prompts, sampling, True, 2 * len(prompts), args.threads, shape,
                                              row_threads=args.threads)
        contenders = {"diffusers": at_threads(args.threads, pipe.run)}
        for name, inv, mode in ENGINES:
            contenders[f"{name}_{mode}"] = at_threads(args.threads, lambda e=engines[inv], m=mode: e.run(m))
        if args.threads > 1:
            for mode in ("ode", "sde"):
                contenders[f"inv_{mode}_rows"] = at_threads(1, lambda m=mode: engines["rows"].run(m))
        try:
            rounds = interleaved_rounds(contenders, args.rounds)
        finally:
            for eng in engines.values():
                eng.engine.shutdown()
    result: dict = {}
    print("| contender | clips/s (median) | best | vs diffusers (median) | best vs best | CPU ms per clip (median) "
          "| vs diffusers (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print_versus(rounds, result, rate_key="cps", rate_digits=4, shown_digits=3)
    record_loadavg(info, "loadavg_end")
    print(f"# load average at end {info.get('loadavg_end')}; {time.perf_counter() - t_start:.0f} s in all")
    result.update({"model": "toy" if args.toy else args.model, "clips": len(prompts), "rounds": args.rounds,
                   "threads": args.threads, "sampling": sampling, "machine": info})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
