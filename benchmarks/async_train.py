"""Asynchronous Flow-GRPO against the synchronous trainer, on the demo config (examples/train.yaml: one replica with 1
torch thread, the trainer with 1 thread).

Three contenders, the same seeds and steps, run one after the other in alternation (`--repeats` rounds of, for every
seed of `--seeds`: synchronous, `max_staleness: 1`, `max_staleness: 1` + `partial_rollout: true`). Each run is a fresh
trainer (replicas, reward worker, agent loop); its startup and its before/after validation are not timed: steps/s is
the runs' steps over the sum of their steps' wall times (`step_s`). Printed per mode: steps/s and samples/s (and their
ratio to synchronous), overlap_frac (share of step time with the rollout and the trainer both busy), staleness, the
exact-replay deviation, and the reward of the last quarter of the steps. A seed sets both the samples' noise (`seed`)
and the trainer (`trainer.seed`: LoRA init, row order), and every mode runs every seed, so the reward is compared
per seed (paired): per mode, the mean and std across seeds of a run's last-quarter reward, and against synchronous
the per-seed difference (mean, std across seeds) and the same lagged by one step (the mode's step t+1 against
synchronous step t: an asynchronous batch t+1 comes from the weights synchronous batch t came from). The optional
mode `sync_reseed` is the synchronous trainer with `trainer.seed` + 1000 (another LoRA init and row order, the same
sample seeds): its difference to synchronous is the run-to-run noise of that comparison. Writes the reward curves of
the first seed's runs on one plot (`--plot`, default docs/async_reward_curve.png). Every run also validates before
and after training (`--val-n` ODE images per validation prompt at fixed seeds, the same for every mode): the validation
reward after training, its gain and its per-seed difference to synchronous say what the policy learned, free of the
training batches' SDE noise and of an asynchronous batch's one-version lag. The last line is JSON.

    python benchmarks/async_train.py              # 30 steps per run (docs/results.md's table; a quiet 2-core machine)
    python benchmarks/async_train.py --steps 3    # a quick check that it runs
    python benchmarks/async_train.py --seeds 0-3 --modes synchronous,async,sync_reseed   # learning, 4 seeds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from _common import machine_info, quiet_libraries, record_loadavg

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {"synchronous": {"max_staleness": 0},
         "async": {"max_staleness": 1},
         "async_partial": {"max_staleness": 1, "partial_rollout": True},
         "sync_reseed": {"max_staleness": 0}}
RESEED = 1000  # sync_reseed's trainer.seed offset


def run(mode: str, args, seed: int, out_dir: str) -> tuple[list[dict], dict[str, float]]:
    """One run: its step metrics and its validation reward before and after training ({"before", "after"}: the
    mean reward of `--val-n` ODE images per validation prompt at fixed seeds, the same for every mode)."""
    from omniroll.config import load_config
    from omniroll.train import Trainer

    trainer_seed = seed + RESEED if mode == "sync_reseed" else seed
    overrides = [f"trainer.steps={args.steps}", "trainer.checkpoint_every=0", "trainer.val_every=0",
                 f"seed={seed}", f"trainer.seed={trainer_seed}", f"val_kwargs.n={args.val_n}"]
    overrides += [f"trainer.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODES[mode].items()]
    cfg = load_config(args.config, overrides=overrides)
    log = print if args.verbose else (lambda s: None)
    with Trainer(cfg, out_dir, log=log) as tr:
        hist = tr.train(args.steps)
    with open(os.path.join(out_dir, "validation.jsonl")) as f:
        val = {rec["tag"]: rec["val_reward_mean"] for rec in map(json.loads, f)}
    return hist, val


def last_quarter(hist: list[dict]) -> list[dict]:
    return hist[-max(1, len(hist) // 4):]


def summary(hists: list[list[dict]]) -> dict:
    """One mode over its runs: rates pooled (all steps over all step wall times), exactness maxima, and the reward
    of the last quarter (mean and std over the per-step means of every run's last quarter)."""
    every = [m for h in hists for m in h]
    wall = sum(m["step_s"] for m in every)
    rewards = [m["reward_mean"] for h in hists for m in last_quarter(h)]
    return {"steps_per_s": len(every) / wall, "samples_per_s": sum(m["num_samples"] for m in every) / wall,
            "overlap_frac": statistics.fmean(m["overlap_frac"] for m in every),
            "staleness_mean": statistics.fmean(m["staleness_mean"] for m in every),
            "staleness_max": max(m["staleness_max"] for m in every),
            "version_span_max": max(m["version_span_max"] for m in every),
            "stale_dropped": sum(m["stale_dropped"] for m in every),
            "behaviour_replay_max_abs_dev": max(m["behaviour_replay_max_abs_dev"] for m in every),
            "prox_ratio_max_abs_dev": max(m["prox_ratio_max_abs_dev"] for m in every),
            "behaviour_ratio_max_abs_dev": max(m["behaviour_ratio_max_abs_dev"] for m in every),
            "behaviour_weight_capped_frac": statistics.fmean(m["behaviour_weight_capped_frac"] for m in every),
            "rollout_s": statistics.median(m["rollout_s"] for m in every),
            "train_s": statistics.median(m["train_s"] for m in every),
            "reward_last_quarter": {"mean": statistics.fmean(rewards),
                                    "std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0}}


def seed_curve(hists: list[list[dict]]) -> list[float]:
    """A seed's reward per step, the mean over its runs (repeats)."""
    T = min(len(h) for h in hists)
    return [statistics.fmean(h[t]["reward_mean"] for h in hists) for t in range(T)]


def lagged_diff(mode: list[float], sync: list[float], lag: int) -> float:
    """Mean over the last quarter (at least 1 + lag steps) of mode[t + lag] - sync[t]."""
    T = min(len(mode), len(sync))
    q = max(1 + lag, T // 4)
    return statistics.fmean(mode[t + lag] - sync[t] for t in range(T - q, T - lag))


def mean_std(xs):
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def validation(vals: dict[str, dict[int, list[dict]]]) -> dict:
    """The validation reward after training per seed (the mean over repeats), its gain over the one before, and
    against synchronous the paired per-seed difference of both: what the policy learned from the same samples, free of
    the training batches' SDE noise and of an asynchronous batch's one-version lag."""
    out = {}
    for mode, by_seed in vals.items():
        after = {s: statistics.fmean(v["after"] for v in vs) for s, vs in by_seed.items()}
        gain = {s: statistics.fmean(v["after"] - v["before"] for v in vs) for s, vs in by_seed.items()}
        rec = {"after": {"per_seed": after, **mean_std(list(after.values()))},
               "gain": {"per_seed": gain, **mean_std(list(gain.values()))}}
        if mode != "synchronous":
            sync_after = out["synchronous"]["after"]["per_seed"]
            diff = {s: a - sync_after[s] for s, a in after.items()}
            rec["after_diff_vs_sync"] = {"per_seed": diff, **mean_std(list(diff.values()))}
        out[mode] = rec
    return out


def learning(runs: dict[str, dict[int, list[list[dict]]]]) -> dict:
    """The reward per seed: per mode the mean and std across seeds of a run's last-quarter reward; against
    synchronous, the paired per-seed difference, at the same step and lagged (the mode's step t+1 vs sync step t)."""

    sync = {s: seed_curve(h) for s, h in runs["synchronous"].items()}
    out = {}
    for mode, by_seed in runs.items():
        curves = {s: seed_curve(h) for s, h in by_seed.items()}
        per_seed = {s: statistics.fmean(c[-max(1, len(c) // 4):]) for s, c in curves.items()}
        rec = {"per_seed": per_seed, **mean_std(list(per_seed.values()))}
        if mode != "synchronous":
            diff = {s: lagged_diff(c, sync[s], 0) for s, c in curves.items()}
            lagged = {s: lagged_diff(c, sync[s], 1) for s, c in curves.items()}
            rec["diff_vs_sync"] = {"per_seed": diff, **mean_std(list(diff.values()))}
            rec["lagged_diff_vs_sync"] = {"per_seed": lagged, **mean_std(list(lagged.values()))}
        out[mode] = rec
    return out


def parse_seeds(text: str) -> list[int]:
    """"0", "0,2,5" or "0-3"."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(text)
    return seeds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every seed and contender (default 1)")
    p.add_argument("--seeds", default="0", help="rollout and trainer seeds, each run by every mode: 0 / 0,1 / 0-3 "
                                                 "(default 0)")
    p.add_argument("--modes", default="synchronous,async,async_partial",
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--config", default=os.path.join(HERE, "..", "examples", "train.yaml"))
    p.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "async_reward_curve.png"))
    p.add_argument("--val-n", type=int, default=16, help="validation images per prompt, before and after each run "
                                                          "(ODE, fixed seeds; default 16)")
    p.add_argument("--verbose", action="store_true", help="print every step line")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.steps < 2 or args.repeats < 1:
        p.error("--steps must be >= 2 and --repeats >= 1")
    if "synchronous" not in modes or not set(modes) <= set(MODES):
        p.error(f"--modes: a subset of {','.join(MODES)} that includes synchronous, got {args.modes!r}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds: distinct ints >= 0 like 0 / 0,1 / 0-3, got {args.seeds!r}")
    quiet_libraries()
    info = machine_info(1)
    record_loadavg(info, "loadavg_before")
    runs: dict[str, dict[int, list[list[dict]]]] = {m: {s: [] for s in seeds} for m in modes}
    vals: dict[str, dict[int, list[dict]]] = {m: {s: [] for s in seeds} for m in modes}
    with tempfile.TemporaryDirectory(prefix="omniroll-async-bench-") as tmp:
        for r in range(args.repeats):
            for seed in seeds:
                for mode in modes:
                    hist, val = run(mode, args, seed, os.path.join(tmp, f"{mode}-{seed}-{r}"))
                    runs[mode][seed].append(hist)
                    vals[mode][seed].append(val)
                    s = summary([hist])
                    print(f"round {r + 1} seed {seed} {mode:<14} {s['steps_per_s']:.3f} steps/s  "
                          f"{s['samples_per_s']:.2f} samples/s  overlap {s['overlap_frac']:.2f}  staleness mean "
                          f"{s['staleness_mean']:.2f} max {s['staleness_max']}  reward(last quarter) "
                          f"{s['reward_last_quarter']['mean']:+.4f}  validation {val['before']:.4f} -> "
                          f"{val['after']:.4f}", flush=True)
    record_loadavg(info, "loadavg_after")
    res = {m: summary([h for hs in by_seed.values() for h in hs]) for m, by_seed in runs.items()}
    learn = learning(runs)
    val = validation(vals)
    base = res["synchronous"]
    print(f"\n{'mode':<14} {'steps/s':>8} {'x sync':>7} {'samples/s':>10} {'x sync':>7} {'overlap':>8} "
          f"{'stale mean/max':>15} {'span':>5} {'rollout s':>10} {'train s':>8} {'replay dev':>10}")
    for m, s in res.items():
        print(f"{m:<14} {s['steps_per_s']:>8.3f} {s['steps_per_s'] / base['steps_per_s']:>7.2f} "
              f"{s['samples_per_s']:>10.2f} {s['samples_per_s'] / base['samples_per_s']:>7.2f} "
              f"{s['overlap_frac']:>8.2f} {s['staleness_mean']:>9.2f} / {s['staleness_max']:<3} "
              f"{s['version_span_max']:>5} {s['rollout_s']:>10.2f} {s['train_s']:>8.2f} "
              f"{s['behaviour_replay_max_abs_dev']:>10.1e}")
    spread = "std across seeds" if len(seeds) > 1 else "std of the per-step means"
    print(f"\nreward, last quarter ({len(seeds)} seed(s); +- : {spread}; diff: minus synchronous, per seed)")
    print(f"{'mode':<14} {'reward':>18} {'diff vs sync':>20} {'lagged diff':>20}   per seed")
    for m, rec in learn.items():
        d, lag = rec.get("diff_vs_sync"), rec.get("lagged_diff_vs_sync")
        sd = rec["std"] if len(seeds) > 1 else res[m]["reward_last_quarter"]["std"]
        cols = [f"{rec['mean']:+.4f} +- {sd:.4f}",
                f"{d['mean']:+.4f} +- {d['std']:.4f}" if d else "", f"{lag['mean']:+.4f} +- {lag['std']:.4f}" if lag
                else ""]
        per = " ".join(f"{v:+.4f}" for v in (d or rec)["per_seed"].values())
        print(f"{m:<14} {cols[0]:>18} {cols[1]:>20} {cols[2]:>20}   {per}")
    print(f"\nvalidation after training ({args.val_n} ODE images per prompt at fixed seeds; +- : std across seeds)")
    print(f"{'mode':<14} {'after':>18} {'gain over before':>20} {'after minus sync':>20}   per seed")
    for m, rec in val.items():
        d = rec.get("after_diff_vs_sync")
        cols = [f"{rec['after']['mean']:+.4f} +- {rec['after']['std']:.4f}",
                f"{rec['gain']['mean']:+.4f} +- {rec['gain']['std']:.4f}",
                f"{d['mean']:+.4f} +- {d['std']:.4f}" if d else ""]
        per = " ".join(f"{v:+.4f}" for v in (d or rec["after"])["per_seed"].values())
        print(f"{m:<14} {cols[0]:>18} {cols[1]:>20} {cols[2]:>20}   {per}")
    from omniroll.train.report.reward_curve import plot_reward_curves

    labels = {"synchronous": "synchronous", "async": "max_staleness 1", "async_partial": "max_staleness 1 + partial",
              "sync_reseed": f"synchronous, trainer.seed + {RESEED}"}
    plot_reward_curves({labels[m]: by_seed[seeds[0]][0] for m, by_seed in runs.items()}, args.plot,
                       title=f"Flow-GRPO demo, {args.steps} steps, seed {seeds[0]}: synchronous vs asynchronous")
    print(f"reward curves -> {os.path.relpath(args.plot)}")
    speedup = {m: res[m]["steps_per_s"] / base["steps_per_s"] if m in res else None for m in MODES}
    out = {"speedup_async": speedup["async"], "speedup_partial": speedup["async_partial"],
           "reward_last_quarter": {m: {"mean": rec["mean"], "std": rec["std"],  # std: across seeds
                                       "step_std": res[m]["reward_last_quarter"]["std"]}  # of the per-step means
                                   for m, rec in learn.items()},
           "reward_diff_vs_sync": {m: rec["diff_vs_sync"] for m, rec in learn.items() if "diff_vs_sync" in rec},
           "reward_lagged_diff_vs_sync": {m: rec["lagged_diff_vs_sync"] for m, rec in learn.items()
                                          if "lagged_diff_vs_sync" in rec},
           "behaviour_replay_max_abs_dev": max(s["behaviour_replay_max_abs_dev"] for s in res.values()),
           "prox_ratio_max_abs_dev": max(s["prox_ratio_max_abs_dev"] for s in res.values()),
           "validation": val, "modes": res, "learning": learn,
           "reward_curves": {m: {s: [[x["reward_mean"] for x in h] for h in hs] for s, hs in by_seed.items()}
                             for m, by_seed in runs.items()},
           "steps": args.steps, "repeats": args.repeats, "seeds": seeds, "machine": info}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
