"""GRPO-Guard's ratio claim on the shapes world: the importance ratio's mean and std per denoising step, Flow-GRPO's
and GRPO-Guard's, read from short trainings' per-timestep statistics (omniroll/train/ratio_steps.py).

GRPO-Guard (arXiv 2510.22319) says Flow-GRPO's ratio "mean is consistently below 1 and becomes significantly
pronounced at low-noise steps ... the variance varies notably across different steps", and that its RatioNorm
removes the bias. Each algorithm's shapes recipe (`examples/shapes_<algorithm>.yaml`) trains a few steps with every
step but the last recorded (`algo.sde_window_size=null`: steps 0 to 8 of 10, the last ones the low-noise steps),
synchronously, and several optimizer updates per step (`micro_batches_per_update=1` over the 48 samples' 3
micro-batches, `num_inner_epochs`), so that the ratios of every micro-batch after the first depart from 1; no
evaluation. The table pools every step's terms per timestep (the first micro-batch's terms included: their ratio is
exactly 1); z is the mean's distance from 1 in standard errors, each (sample, timestep) counted once (the inner epochs
score it again, correlated). Ends with one JSON line.

    python benchmarks/ratio_per_timestep.py --out out/ratio_per_timestep                 # train both, tabulate
    python benchmarks/ratio_per_timestep.py --out out/ratio_per_timestep --read-only     # tabulate existing runs
    python benchmarks/ratio_per_timestep.py --out out/ratio_lr3e-3 --algorithms flow_grpo --override trainer.lr=0.003
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)

from omniroll.train.ratio_steps import add_step_sums, ratio_step_metrics, split_step_key, step_key  # noqa: E402

ALGORITHMS = ("flow_grpo", "grpo_guard")


def overrides(args) -> list[str]:
    return ["algo.sde_window_size=null", "algo.sde_window_range=null", "trainer.max_staleness=0",
            "trainer.evaluation=null", "trainer.checkpoint_every=0", "trainer.micro_batches_per_update=1",
            f"trainer.num_inner_epochs={args.epochs}", "trainer.policy_move_rows=0", "trainer.signal_every=0",
            f"trainer.seed={args.seed}", f"seed={args.seed}"] + list(args.override or [])


def train(algorithm: str, args) -> float:
    """One run of the algorithm's recipe into `args.out/<algorithm>`; its wall seconds."""
    cmd = [sys.executable, "-c", "import sys; from omniroll.cli import main; sys.exit(main(sys.argv[1:]))", "train",
           "--config",
           os.path.join(ROOT, "examples", f"shapes_{algorithm}.yaml"), "--out", os.path.join(args.out, algorithm),
           "--steps", str(args.steps), "--quiet"] + [x for o in overrides(args) for x in ("--override", o)]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.time() - t0


def pooled(records: list[dict]) -> dict:
    """The per-timestep statistics of every step's record pooled (their sums added: `ratio_step_metrics`)."""
    sums: dict = {}
    for m in records:
        for key in m:
            parsed = split_step_key(key)
            if parsed is None or parsed[0] != "ratio_samples":
                continue
            t = parsed[1]
            n = m[key]
            mean, std = m[step_key("ratio_mean", t)], m[step_key("ratio_std", t)]
            add_step_sums(sums, {t: [n, n * (mean - 1), n * (std ** 2 + (mean - 1) ** 2),
                                     n * m[step_key("clip_frac_higher", t)], n * m[step_key("clip_frac_lower", t)],
                                     n * m[step_key("log_prob_abs_diff", t)]]})
    return ratio_step_metrics(sums)


def z_score(mean: float, std: float, terms: int, epochs: int) -> float:
    """(mean - 1) over its standard error, counting each (sample, timestep) once (the epochs score it again)."""
    return (mean - 1) / (std / (terms / epochs) ** 0.5) if std > 0 else 0.0


def table(name: str, m: dict, epochs: int) -> list[str]:
    steps = sorted({split_step_key(k)[1] for k in m if split_step_key(k) is not None})
    lines = [f"{name}: ratio per denoising step (pooled over the run's steps; 0 = the noisiest)", "",
             "| step | ratio mean - 1 | z | ratio std | clipped above | clipped below | mean \\|logp diff\\| | terms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in steps + [None]:
        def g(n):
            return m[n] if t is None else m[step_key(n, t)]
        z = z_score(g("ratio_mean"), g("ratio_std"), g("ratio_samples"), epochs)
        lines.append(f"| {'all' if t is None else t} | {g('ratio_mean') - 1:+.2e} | {z:+.2f} | {g('ratio_std'):.2e} | "
                     f"{g('clip_frac_higher'):.3f} | {g('clip_frac_lower'):.3f} | {g('log_prob_abs_diff'):.2e} | "
                     f"{g('ratio_samples')} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/ratio_per_timestep")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run")
    ap.add_argument("--epochs", type=int, default=2, help="inner epochs per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--read-only", action="store_true", help="tabulate the runs already in --out")
    ap.add_argument("--override", action="append", help="a further config override for both runs, e.g. "
                                                         "trainer.lr=0.003 (repeatable)")
    args = ap.parse_args()
    result = {"steps": args.steps, "epochs": args.epochs, "seed": args.seed, "overrides": list(args.override or [])}
    for algorithm in args.algorithms.split(","):
        if not args.read_only:
            result[f"{algorithm}_wall_s"] = round(train(algorithm, args), 1)
        path = os.path.join(args.out, algorithm, "metrics.jsonl")
        records = [json.loads(x) for x in open(path) if x.strip()]
        m = pooled([r for r in records if "reward_mean" in r])
        print("\n".join(table(algorithm, m, args.epochs)) + "\n", flush=True)
        result[algorithm] = {k: v for k, v in m.items() if split_step_key(k) is not None and
                             split_step_key(k)[0] in ("ratio_mean", "ratio_std")} | {
            "ratio_mean": m["ratio_mean"], "ratio_std": m["ratio_std"]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
