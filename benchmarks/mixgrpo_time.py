"""MixGRPO's time claim on the shapes world: DanceGRPO's recipe against MixGRPO's window and MixGRPO-Flash's solver,
timed at equal samples.

MixGRPO (arXiv 2507.21802) says it trains "with nearly 50 % lower training time" than DanceGRPO, and MixGRPO-Flash
"further reduces training time by 71 %". Its saving: DanceGRPO injects noise at every step and trains a share of
them (`timestep_fraction`); MixGRPO samples with the ODE outside a small SDE window that slides over the schedule and
trains only the window's steps; Flash adds DPM-Solver++ for the ODE part after the window.

The contenders, each `examples/shapes_dance_grpo.yaml` (the shipped shapes model, 10 steps, CFG 4.5, 6 prompts x 8
samples a step, LoRA, dance_sde at eta 0.3) with these changes:

    dance_grpo     the recipe: dance_sde at every step but the last (9 recorded), int(9 x 0.6) = 5 trained a sample
    mixgrpo        an SDE window of 2 steps in steps 0-4 (the size and range of VeRL-Omni's MixGRPO recipe on 10
                   steps; the paper's window is 4 of 25 steps), sliding as MixGRPO's reference does
                   (`trainer.window_schedule: progressive`, one step every 25 training steps, its iters_per_group),
                   the ODE elsewhere, every window step trained (timestep_fraction 1.0)
    mixgrpo_flash  mixgrpo with `pipeline.solver: dpmpp_2m` (DPM-Solver++(2M) outside the window)

Every run is `omniroll train` for `--steps` steps, synchronously (`trainer.max_staleness=0`, as both papers' trainers
run: a step is its rollout, then its update, so the phases add up to the step), without evaluation, checkpoints, the
gradient-signal meter or the policy-move measurement (work that no contender needs); the first step of each run
(start-up) is not counted. Runs go in rounds, each round every contender once in a rotated order, so a slower hour of
the machine falls on all of them. Reported per contender: the median step wall time (the trainer's `step_s`), its
rollout and update times, the trained steps per sample, and the ratio to DanceGRPO's. The rollout's transformer
forwards are the same for all three (the same 10 steps with CFG; DPM-Solver++ reuses the previous model output, it
draws no extra forward). Ends with one JSON line.

    python benchmarks/mixgrpo_time.py                         # 3 contenders x 2 rounds of 6 steps (about 10 minutes)
    python benchmarks/mixgrpo_time.py --steps 2 --rounds 1    # does it run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)

from _common import emit_record, machine_info, record_loadavg, rotated  # noqa: E402

CONFIG = os.path.join(ROOT, "examples", "shapes_dance_grpo.yaml")
MIX = ["algo.sde_window_size=2", "algo.sde_window_range=[0,5]", "trainer.window_schedule=progressive",
       "trainer.window_advance_every=25", "trainer.algorithm_options.timestep_fraction=1.0"]
CONTENDERS = {"dance_grpo": [], "mixgrpo": MIX, "mixgrpo_flash": MIX + ["pipeline.solver=dpmpp_2m"]}
#: trained steps per sample: DanceGRPO int(9 recorded x 0.6), MixGRPO its window
TRAINED_STEPS = {"dance_grpo": 5, "mixgrpo": 2, "mixgrpo_flash": 2}
COMMON = ["trainer.max_staleness=0", "trainer.evaluation=null", "trainer.checkpoint_every=0", "trainer.signal_every=0",
          "trainer.policy_move_rows=0"]


def train(name: str, out: str, args) -> list[dict]:
    """One run of contender `name` into `out`; its step records."""
    overrides = COMMON + CONTENDERS[name] + [f"trainer.seed={args.seed}", f"seed={args.seed}"]
    cmd = [sys.executable, "-c", "import sys; from omniroll.cli import main; sys.exit(main(sys.argv[1:]))", "train",
           "--config", CONFIG, "--out", out, "--steps", str(args.steps), "--quiet"]
    cmd += [x for o in overrides for x in ("--override", o)]
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if "step_s" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps per run (the first is not counted)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each contender, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/mixgrpo_time")
    args = ap.parse_args()
    if args.steps < 2 or args.rounds < 1:
        ap.error(f"--steps must be >= 2 (the first is not counted) and --rounds >= 1, got {args.steps}, "
                 f"{args.rounds}")
    info = machine_info(1)
    names = list(CONTENDERS)
    steps: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in rotated(names, r):
            t0 = time.time()
            records = train(name, os.path.join(args.out, f"{name}-{r}"), args)
            steps[name] += records[1:]
            print(f"  {len(records)} steps in {time.time() - t0:.0f} s", flush=True)
    record_loadavg(info, "loadavg_end")

    def med(name, key):
        return statistics.median(m[key] for m in steps[name])

    result = {"steps_per_run": args.steps, "rounds": args.rounds, "counted_steps": len(steps["dance_grpo"]),
              "samples_per_step": steps["dance_grpo"][0]["num_samples"], "machine": info}
    print("\n| contender | trained steps a sample | step s (median) | rollout s | update s | step vs DanceGRPO |"
          " training time saved |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = med("dance_grpo", "step_s")
    for name in names:
        step, ratio = med(name, "step_s"), med(name, "step_s") / base
        result[name] = {"step_s": round(step, 2), "rollout_s": round(med(name, "rollout_s"), 2),
                        "train_s": round(med(name, "train_s"), 2), "trained_steps": TRAINED_STEPS[name],
                        "ratio": round(ratio, 3)}
        print(f"| {name} | {TRAINED_STEPS[name]} | {step:.2f} | {med(name, 'rollout_s'):.2f} | "
              f"{med(name, 'train_s'):.2f} | {ratio:.2f}x | {100 * (1 - ratio):.0f} % |")
    print()
    emit_record(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
