"""Asynchronous Flow-GRPO against the synchronous trainer, on the demo config (examples/train.yaml: one replica with 1
torch thread, the trainer with 1 thread).

Three contenders, the same seeds and steps, run one after the other in alternation (`--repeats` rounds of:
synchronous, `max_staleness: 1`, `max_staleness: 1` + `partial_rollout: true`). Each run is a fresh trainer (replicas,
reward worker, agent loop); its startup and its before/after validation are not timed: steps/s is the run's steps over
the sum of its steps' wall times (`step_s`). Printed per mode: steps/s and samples/s (and their ratio to
synchronous), overlap_frac (share of step time with the rollout and the trainer both busy), staleness, the exact-replay
deviation, and the reward of the last quarter of the steps (mean and std of the per-step mean reward). Writes the reward
curves of all modes on one plot (`--plot`, default docs/async_reward_curve.png). The last line is JSON.

    python benchmarks/async_train.py              # 30 steps per run (the README's table; a quiet 2-core machine)
    python benchmarks/async_train.py --steps 3    # a quick check that it runs
    python benchmarks/async_train.py --seed 1 --modes synchronous,async   # another seed, two contenders
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
         "async_partial": {"max_staleness": 1, "partial_rollout": True}}


def run(mode: str, args, out_dir: str) -> list[dict]:
    from omniroll.config import load_config
    from omniroll.train import FlowGRPOTrainer

    overrides = [f"trainer.steps={args.steps}", "trainer.checkpoint_every=0", "trainer.val_every=0",
                 f"seed={args.seed}", f"trainer.seed={args.seed}"]
    overrides += [f"trainer.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODES[mode].items()]
    cfg = load_config(args.config, overrides=overrides)
    log = print if args.verbose else (lambda s: None)
    with FlowGRPOTrainer(cfg, out_dir, log=log) as tr:
        return tr.train(args.steps)


def summary(hist: list[dict]) -> dict:
    wall = sum(m["step_s"] for m in hist)
    quarter = hist[-max(1, len(hist) // 4):]
    rewards = [m["reward_mean"] for m in quarter]
    return {"steps_per_s": len(hist) / wall, "samples_per_s": sum(m["num_samples"] for m in hist) / wall,
            "overlap_frac": statistics.fmean(m["overlap_frac"] for m in hist),
            "staleness_mean": statistics.fmean(m["staleness_mean"] for m in hist),
            "staleness_max": max(m["staleness_max"] for m in hist),
            "version_span_max": max(m["version_span_max"] for m in hist),
            "stale_dropped": sum(m["stale_dropped"] for m in hist),
            "behaviour_replay_max_abs_dev": max(m["behaviour_replay_max_abs_dev"] for m in hist),
            "prox_ratio_max_abs_dev": max(m["prox_ratio_max_abs_dev"] for m in hist),
            "behaviour_ratio_max_abs_dev": max(m["behaviour_ratio_max_abs_dev"] for m in hist),
            "behaviour_weight_capped_frac": statistics.fmean(m["behaviour_weight_capped_frac"] for m in hist),
            "rollout_s": statistics.median(m["rollout_s"] for m in hist),
            "train_s": statistics.median(m["train_s"] for m in hist),
            "reward_last_quarter": {"mean": statistics.fmean(rewards),
                                    "std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three contenders (default 1)")
    p.add_argument("--seed", type=int, default=0, help="rollout and trainer seed of every run (default 0)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--config", default=os.path.join(HERE, "..", "examples", "train.yaml"))
    p.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "async_reward_curve.png"))
    p.add_argument("--verbose", action="store_true", help="print every step line")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.steps < 2 or args.repeats < 1:
        p.error("--steps must be >= 2 and --repeats >= 1")
    if "synchronous" not in modes or not set(modes) <= set(MODES):
        p.error(f"--modes: a subset of {','.join(MODES)} that includes synchronous, got {args.modes!r}")
    quiet_libraries()
    info = machine_info(1)
    record_loadavg(info, "loadavg_before")
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="omniroll-async-bench-") as tmp:
        for r in range(args.repeats):
            for mode in modes:
                hist = run(mode, args, os.path.join(tmp, f"{mode}-{r}"))
                runs[mode].append(hist)
                s = summary(hist)
                print(f"round {r + 1} {mode:<14} {s['steps_per_s']:.3f} steps/s  {s['samples_per_s']:.2f} samples/s  "
                      f"overlap {s['overlap_frac']:.2f}  staleness mean {s['staleness_mean']:.2f} max "
                      f"{s['staleness_max']}  reward(last quarter) {s['reward_last_quarter']['mean']:+.4f}",
                      flush=True)
    record_loadavg(info, "loadavg_after")
    res = {m: summary([x for h in hs for x in h]) if args.repeats == 1 else _median_of(hs) for m, hs in runs.items()}
    base = res["synchronous"]
    print(f"\n{'mode':<14} {'steps/s':>8} {'x sync':>7} {'samples/s':>10} {'x sync':>7} {'overlap':>8} "
          f"{'stale mean/max':>15} {'span':>5} {'rollout s':>10} {'train s':>8} {'reward last 1/4':>18} "
          f"{'replay dev':>10}")
    for m, s in res.items():
        q = s["reward_last_quarter"]
        print(f"{m:<14} {s['steps_per_s']:>8.3f} {s['steps_per_s'] / base['steps_per_s']:>7.2f} "
              f"{s['samples_per_s']:>10.2f} {s['samples_per_s'] / base['samples_per_s']:>7.2f} "
              f"{s['overlap_frac']:>8.2f} {s['staleness_mean']:>9.2f} / {s['staleness_max']:<3} "
              f"{s['version_span_max']:>5} {s['rollout_s']:>10.2f} {s['train_s']:>8.2f} "
              f"{q['mean']:>+9.4f} +- {q['std']:.4f} {s['behaviour_replay_max_abs_dev']:>10.1e}")
    from omniroll.train.tracking import plot_reward_curves

    labels = {"synchronous": "synchronous", "async": "max_staleness 1", "async_partial": "max_staleness 1 + partial"}
    plot_reward_curves({labels[m]: hs[0] for m, hs in runs.items()}, args.plot,
                       title=f"Flow-GRPO demo, {args.steps} steps: synchronous vs asynchronous")
    print(f"reward curves -> {os.path.relpath(args.plot)}")
    speedup = {m: res[m]["steps_per_s"] / base["steps_per_s"] if m in res else None for m in MODES}
    out = {"speedup_async": speedup["async"], "speedup_partial": speedup["async_partial"],
           "reward_last_quarter": {m: s["reward_last_quarter"] for m, s in res.items()},
           "behaviour_replay_max_abs_dev": max(s["behaviour_replay_max_abs_dev"] for s in res.values()),
           "prox_ratio_max_abs_dev": max(s["prox_ratio_max_abs_dev"] for s in res.values()),
           "modes": res, "steps": args.steps, "repeats": args.repeats, "seed": args.seed,
           "machine": info}
    print(json.dumps(out))
    return 0


def _median_of(hists: list[list[dict]]) -> dict:
    """Per-round summaries; rates and overlap: the median round; reward: over every round's last quarter."""
    per = [summary(h) for h in hists]
    med = dict(per[0])
    for k in ("steps_per_s", "samples_per_s", "overlap_frac", "staleness_mean", "rollout_s", "train_s"):
        med[k] = statistics.median(s[k] for s in per)
    for k in ("staleness_max", "version_span_max", "behaviour_replay_max_abs_dev", "prox_ratio_max_abs_dev",
              "behaviour_ratio_max_abs_dev", "behaviour_weight_capped_frac"):
        med[k] = max(s[k] for s in per)
    med["stale_dropped"] = sum(s["stale_dropped"] for s in per)
    rewards = [m["reward_mean"] for h in hists for m in h[-max(1, len(h) // 4):]]
    med["reward_last_quarter"] = {"mean": statistics.fmean(rewards), "std": statistics.pstdev(rewards)}
    return med


if __name__ == "__main__":
    sys.exit(main())
