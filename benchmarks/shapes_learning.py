"""What Flow-GRPO teaches the shapes model, and how fast: GenEval's strict accuracy on the shapes world before and
after training, per category, on the training prompts and on the held-out ones, over several seeds, for the
synchronous trainer and the asynchronous one (`max_staleness: 1`, with and without `partial_rollout`).

Every run is a fresh `Trainer` on `--config` (default examples/shapes_flow_grpo.yaml, the full recipe) whose
`trainer.evaluation` evaluates both splits before the first step, every `trainer.val_every` steps and after the last
(the ODE at fixed seeds: the same pictures for every mode and seed, so differences are the weights'). A seed sets the
samples' noise (`seed`) and the trainer (`trainer.seed`); every mode runs every seed. Training time is the sum of the
steps' wall times (`step_s`; startup and evaluations are not counted), so "per second" compares the trainers'
speed-weighted learning and "per sample" their learning from the same data. Printed: per mode, the mean +- std across
seeds of the accuracy after training, its gain, the training minutes and samples, the gain per 1000 samples and per
training minute, and the accuracy each mode had reached at the shortest run's training time (read off its evaluation
curve, linearly between evaluations); then the per-category accuracies after training. The last line is JSON.

    python benchmarks/shapes_learning.py                                   # 3 seeds x 3 modes of the full recipe
    python benchmarks/shapes_learning.py --modes synchronous --seeds 0 --steps 4   # a quick check that it runs
    python benchmarks/shapes_learning.py --config examples/shapes_demo.yaml --modes synchronous --seeds 0-2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from _common import machine_info, quiet_libraries, record_loadavg, run_evaluations

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {"synchronous": {"max_staleness": 0},
         "async": {"max_staleness": 1},
         "async_partial": {"max_staleness": 1, "partial_rollout": True}}


def parse_seeds(text: str) -> list[int]:
    """"0", "0,2,5" or "0-3"."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(text)
    return seeds


def run(mode: str, args, seed: int, out_dir: str) -> dict:
    """One run: its step records, its evaluation records (each with the training seconds and samples before it)."""
    from omniroll.config import load_config
    from omniroll.train import Trainer
    from omniroll.train.report.tracking import read_jsonl

    overrides = [f"seed={seed}", f"trainer.seed={seed}", "trainer.checkpoint_every=0"]
    overrides += [f"trainer.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODES[mode].items()]
    if args.steps:
        overrides.append(f"trainer.steps={args.steps}")
    cfg = load_config(args.config, overrides=overrides)
    if cfg.trainer.evaluation is None:
        raise SystemExit(f"{args.config}: trainer.evaluation must be set (the benchmark reads its accuracies)")
    log = print if args.verbose else (lambda s: None)
    with Trainer(cfg, out_dir, log=log) as tr:
        tr.train()
    recs = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    steps = [r for r in recs if "reward_mean" in r]
    seconds, samples = {0: 0.0}, {0: 0}
    for m in steps:
        seconds[m["step"]] = seconds[m["step"] - 1] + m["step_s"]
        samples[m["step"]] = samples[m["step"] - 1] + m["num_samples"]
    evals = [{**r, "train_s": seconds[r["step"]], "samples": samples[r["step"]]} for r in recs if "eval" in r]
    paired = {name: e["paired"]["overall"] for name, e in run_evaluations(out_dir).items()}
    return {"steps": steps, "evals": evals, "paired": paired}


def mean_std(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def at_time(evals: list[dict], key: str, t: float) -> float:
    """`key` at training time t, linear between evaluations."""
    pts = [(e["train_s"], e[key]) for e in evals]
    for (t0, y0), (t1, y1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return y0 + (y1 - y0) * (t - t0) / max(t1 - t0, 1e-9)
    return pts[-1][1]


def categories(by_seed: dict, split: str) -> list[str]:
    """The GenEval categories the runs' last evaluation of `split` reports."""
    return sorted({k.split("/")[2] for r in by_seed.values() for k in r["evals"][-1]
                   if k.startswith(f"eval/{split}/") and k.endswith("/strict") and k.count("/") == 3})


def summarise(runs: dict[str, dict[int, dict]], splits: list[str]) -> dict:
    shortest = min(r["evals"][-1]["train_s"] for by_seed in runs.values() for r in by_seed.values())
    out = {}
    for mode, by_seed in runs.items():
        rec: dict = {}
        for split in splits:
            key = f"eval/{split}/strict"
            before = [r["evals"][0][key] for r in by_seed.values()]
            after = [r["evals"][-1][key] for r in by_seed.values()]
            gain = [a - b for a, b in zip(after, before)]
            minutes = [r["evals"][-1]["train_s"] / 60 for r in by_seed.values()]
            samples = [r["evals"][-1]["samples"] for r in by_seed.values()]
            rec[split] = {"before": mean_std(before), "after": mean_std(after), "gain": mean_std(gain),
                          "gain_per_1000_samples": mean_std([g / s * 1000 for g, s in zip(gain, samples)]),
                          "gain_per_minute": mean_std([g / m for g, m in zip(gain, minutes)]),
                          "at_shortest_time": mean_std([at_time(r["evals"], key, shortest) for r in by_seed.values()]),
                          "per_seed_after": dict(zip(by_seed, after)),
                          "paired_z": [r["paired"][split]["z"] for r in by_seed.values()]}
            cats = categories(by_seed, split)
            rec[split]["categories_after"] = {c: mean_std([r["evals"][-1][f"eval/{split}/{c}/strict"]
                                                           for r in by_seed.values()]) for c in cats}
            rec[split]["categories_before"] = {c: mean_std([r["evals"][0][f"eval/{split}/{c}/strict"]
                                                            for r in by_seed.values()]) for c in cats}
        rec["train_minutes"] = mean_std([r["evals"][-1]["train_s"] / 60 for r in by_seed.values()])
        rec["samples"] = mean_std([r["evals"][-1]["samples"] for r in by_seed.values()])
        out[mode] = rec
    return {"modes": out, "shortest_train_s": shortest}


def pct(d: dict) -> str:
    return f"{100 * d['mean']:5.1f} +- {100 * d['std']:4.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(HERE, "..", "examples", "shapes_flow_grpo.yaml"))
    p.add_argument("--modes", default="synchronous,async,async_partial", help=f"a subset of {','.join(MODES)}")
    p.add_argument("--seeds", default="0-2", help="rollout and trainer seeds, each run by every mode (default 0-2)")
    p.add_argument("--steps", type=int, default=0, help="training steps per run (default: the config's)")
    p.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "shapes_learning.png"))
    p.add_argument("--verbose", action="store_true", help="print every step line")
    p.add_argument("--keep", default=None, help="keep each run's directory (metrics, eval tables and grids) under "
                                                 "this folder as MODE-SEED/ (default: a temporary folder)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(MODES):
        p.error(f"--modes: a subset of {','.join(MODES)}, got {args.modes!r}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds: distinct ints >= 0 like 0 / 0,1 / 0-3, got {args.seeds!r}")
    quiet_libraries()
    info = machine_info(1)
    record_loadavg(info, "loadavg_before")
    runs: dict[str, dict[int, dict]] = {m: {} for m in modes}
    with tempfile.TemporaryDirectory(prefix="omniroll-shapes-bench-") as scratch:
        tmp = args.keep or scratch
        for seed in seeds:
            for mode in modes:
                r = run(mode, args, seed, os.path.join(tmp, f"{mode}-{seed}"))
                runs[mode][seed] = r
                first, last = r["evals"][0], r["evals"][-1]
                line = "  ".join(f"{k.split('/')[1]} {100 * first[k]:.1f} -> {100 * last[k]:.1f} %"
                                 for k in first if k.startswith("eval/") and k.count("/") == 2
                                 and k.endswith("/strict"))
                print(f"seed {seed} {mode:<14} {line}  ({last['train_s'] / 60:.1f} training min, {last['samples']} "
                      f"samples)", flush=True)
    record_loadavg(info, "loadavg_after")
    splits = sorted({k.split("/")[1] for by_seed in runs.values() for r in by_seed.values() for k in r["evals"][0]
                     if k.startswith("eval/") and k.count("/") == 2})
    res = summarise(runs, splits)
    base = res["modes"][modes[0]]
    for split in splits:
        print(f"\n{split} prompts, strict accuracy % (mean +- std over {len(seeds)} seed(s))")
        print(f"{'mode':<14} {'before':>13} {'after':>13} {'gain':>13} {'paired z per seed':>20} "
              f"{'per 1k samples':>15} {'per minute':>13} {'at {:.1f} min'.format(res['shortest_train_s'] / 60):>13} "
              f"{'x ' + modes[0] + ' gain':>14}")
        for m, rec in res["modes"].items():
            s = rec[split]
            ratio = s["gain"]["mean"] / base[split]["gain"]["mean"] if base[split]["gain"]["mean"] else float("nan")
            zs = " ".join(f"{z:+.1f}" for z in s["paired_z"])
            print(f"{m:<14} {pct(s['before']):>13} {pct(s['after']):>13} {pct(s['gain']):>13} {zs:>20} "
                  f"{pct(s['gain_per_1000_samples']):>15} {pct(s['gain_per_minute']):>13} "
                  f"{pct(s['at_shortest_time']):>13} {ratio:>14.2f}")
        print("paired z: each seed's after against its before at the same evaluation seeds; |z| < 2 is no detectable "
              "change")
        cats = list(base[split]["categories_after"])
        print(f"{'per category':<14} " + " ".join(f"{c[:12]:>14}" for c in cats))
        for m, rec in res["modes"].items():
            print(f"{m:<14} " + " ".join(f"{pct(rec[split]['categories_after'][c]):>14}" for c in cats))
        print(f"{'(before)':<14} " + " ".join(f"{pct(base[split]['categories_before'][c]):>14}" for c in cats))
    for m, rec in res["modes"].items():
        print(f"{m}: {rec['train_minutes']['mean']:.1f} +- {rec['train_minutes']['std']:.1f} training minutes, "
              f"{rec['samples']['mean']:.0f} samples")
    plot(runs, splits, args.plot)
    print(f"evaluation curves -> {os.path.relpath(args.plot)}")
    out = {**res, "config": os.path.relpath(args.config), "seeds": seeds, "machine": info,
           "curves": {m: {s: [{k: v for k, v in e.items() if k in ("step", "train_s", "samples") or
                               (k.startswith("eval/") and k.count("/") == 2)} for e in r["evals"]]
                          for s, r in by_seed.items()} for m, by_seed in runs.items()}}
    print(json.dumps(out))
    return 0


def plot(runs: dict[str, dict[int, dict]], splits: list[str], path: str) -> None:
    """Per split: overall strict accuracy against training minutes, one line per run (colour: mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(splits), figsize=(5.4 * len(splits), 3.8), dpi=100, squeeze=False)
    for ax, split in zip(axes[0], splits):
        for i, (mode, by_seed) in enumerate(runs.items()):
            for j, (seed, r) in enumerate(by_seed.items()):
                ax.plot([e["train_s"] / 60 for e in r["evals"]], [100 * e[f"eval/{split}/strict"] for e in r["evals"]],
                        color=f"C{i}", marker="o", ms=3, alpha=0.8, label=mode if j == 0 else None)
        ax.set_title(f"{split} prompts")
        ax.set_xlabel("training minutes (steps' wall time)")
        ax.set_ylabel("strict accuracy %")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Flow-GRPO on the shapes world (omniroll): GenEval strict accuracy")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
