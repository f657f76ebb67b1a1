"""Reward hacking, measured against the exact judge: train the shapes model on the proxy that can be fooled
(`shapes_proxy`), judge it with the checker, and compare the controls that are meant to stop the proxy from being
fooled, each one option on the trainer, over several seeds.

Every run is `--config` (default examples/shapes_demo.yaml: AWM, CFG-free, its evaluation before and after at fixed
seeds) with its reward replaced: `proxy: shapes_proxy` trained, and judged at weight 0 beside it `geneval` (the
checker's partial credit), `strict` (its pass / fail) and `graded` (`shapes_continuous`: the checker's terms graded,
the auxiliary reward GARDO's gate ranks against; GARDO ranks against other learned reward models, and no independent
one scores every shapes prompt here, so this auxiliary knows the world better than GARDO's do: the gate's result is
a best case). The controls:

    none      no KL term (kl_beta 0)
    kl_base   the KL to the base model at --kl-beta
    kl_ema    the KL to an EMA of the policy (AWM's; kl_reference ema, decay 0.99) at --kl-beta
    gardo     GARDO: the KL gated on the samples the proxy likes more than `graded` does (adaptive share), to a
              reference reset every 10 steps, with the diversity bonus, at --kl-beta
    data      DDRL's idea: no KL, the flow-matching loss on the world's own renders at --data-weight

Per run: the proxy's gain (the mean of `reward/proxy/mean` over the last 3 steps minus the first 3: on-policy
samples), the judge's partial-credit gain the same way, and the judge's verdict at the evaluation's fixed seeds: strict
accuracy before and after on the training and held-out prompts, with the paired McNemar z (pictures flipped fail ->
pass against pass -> fail; |z| < 2: no detectable change). Hacking is a proxy gain the judge does not share: the
table puts them side by side. The JSON keeps every step's curves on its on-policy samples (the proxy, the judge's
partial credit and its strict pass, the diversity distance): where the judge turns while the proxy rises. The
same at fixed seeds: every validation draws the training prompts (`--val-pictures` each, the ODE, the seeds fixed)
and the proxy and the judge (`reward.held_out`) score each picture, so `validation_curve` gives both means and their
paired z against the base at every validation; with `--val-every` the task evaluation runs there too
(`evaluation_curve`: strict accuracy and McNemar's z against the base, per evaluation). Each evaluation also counts
what the proxy, which counts badly, teaches: the pictures failing for an extra object before and after, with their
paired z (`extra_failures_before`, `_after`, `_z`), and the share showing one (`extra_before`, `extra_after`). Where
the `none` run of a seed is there (in this comparison, or kept in `--none-from`), every other control's evaluations
after training are paired with its pictures (`against_none`): the control's own effect, since both runs share their
training seed. The last line is JSON.
Runs go seed by seed (every control's seed 0 first); with `--keep DIR` each run's result is kept in
`DIR/CONTROL-SEED/result.json` and a rerun reads the finished ones back.

Run it from the repository root (the config's prompt files are relative to it):

    python benchmarks/reward_hacking.py                                   # 5 controls x 3 seeds (hours on 2 cores)
    python benchmarks/reward_hacking.py --controls gardo,data --seeds 0 --steps 2 --eval-seeds 1   # does it run
    python benchmarks/reward_hacking.py --config examples/shapes_awm.yaml --controls none --val-every 25 \
        --keep out/hacking-100                                            # 100 steps, the curves every 25
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import yaml

from _common import machine_info, quiet_libraries, record_loadavg, run_evaluations

HERE = os.path.dirname(os.path.abspath(__file__))
CONTROLS = ("none", "kl_base", "kl_ema", "gardo", "data")
FIRST_LAST = 3  # steps averaged at each end of a run for the on-policy gains


def control_trainer(control: str, kl_beta: float, data_weight: float) -> dict:
    """The trainer keys a control sets."""
    return {"none": {"kl_beta": 0.0},
            "kl_base": {"kl_beta": kl_beta},
            "kl_ema": {"kl_beta": kl_beta, "kl_reference": "ema", "kl_reference_decay": 0.99},
            "gardo": {"kl_beta": kl_beta, "kl_reference": "reset", "kl_reference_every": 10, "diversity_bonus": True,
                      "kl_gate": {"against": ["graded"], "share": 0.1, "adaptive": True}},
            "data": {"kl_beta": 0.0, "data_regularizer": {"weight": data_weight, "batch": 4}}}[control]


def run_config(path: str, control: str, seed: int, args) -> dict:
    """The config of one run: `path` with the proxy trained, the judges at weight 0, the control, the seed."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw["reward"]["functions"] = {"proxy": {"fn": "shapes_proxy"},
                                  "geneval": {"fn": "shapes", "weight": 0.0},
                                  "strict": {"fn": "shapes_strict", "weight": 0.0},
                                  "graded": {"fn": "shapes_continuous", "weight": 0.0}}
    # the judge scores the validation pictures too (fixed prompts and seeds): validation.jsonl keeps each picture's
    # proxy (the trained reward) and judge verdicts, so the two curves pair picture by picture with the first
    raw["reward"]["held_out"] = {"judge": {"fn": "shapes_strict"}}
    raw["seed"] = seed
    tr = raw["trainer"]
    tr.update(seed=seed, checkpoint_every=0, **control_trainer(control, args.kl_beta, args.data_weight))
    if args.steps:
        tr["steps"] = args.steps
    if args.eval_seeds:
        tr["evaluation"]["seeds"] = args.eval_seeds
    if args.val_every:  # the task evaluation and the validation every val_every steps: the curves at fixed seeds
        tr["val_every"] = args.val_every
    tr["val_prompts"] = list(tr.get("prompts", []))  # the training prompts (files relative to the repository root)
    if tr.get("prompts_file"):
        with open(tr["prompts_file"]) as f:
            tr["val_prompts"] += [line.strip() for line in f if line.strip()]
    raw.setdefault("val_kwargs", {})["n"] = args.val_pictures
    return raw


def validation_curve(out_dir: str) -> list[dict]:
    """Per validation (validation.jsonl): its step, the proxy's and the judge's means over the validation pictures
    (the training prompts at fixed seeds), and the paired z of each against the first validation (the base)."""
    from omniroll.evaluation.paired import paired_z
    from omniroll.train.report.tracking import read_jsonl

    recs = [r for r in read_jsonl(os.path.join(out_dir, "validation.jsonl")) if "held_out/rows" in r]
    if not recs:
        return []
    first = recs[0]["held_out/rows"]
    curve = []
    for r in recs:
        rows = r["held_out/rows"]
        point = {"step": r["step"], "tag": r["tag"]}
        for name, key in (("proxy", "trained"), ("judge", "judge")):
            pairs = [(a, b) for a, b in zip(first[key], rows[key]) if a is not None and b is not None]
            point[name] = statistics.fmean(b for _, b in pairs) if pairs else None
            z = paired_z([a for a, _ in pairs], [b for _, b in pairs]) if len(pairs) > 1 else 0.0
            point[f"{name}_z"] = max(-99.0, min(99.0, z))  # every picture moved alike: +-inf; JSON has none
        curve.append(point)
    return curve


def evaluation_curve(out_dir: str) -> list[dict]:
    """Per task evaluation (metrics.jsonl): its step and, per evaluation, the judge's strict accuracy and its paired
    z against the evaluation before training (McNemar's, at the same prompts and seeds)."""
    from omniroll.train.report.tracking import read_jsonl

    curve = []
    for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl")):
        if "eval" not in r:
            continue
        names = sorted({k.split("/")[1] for k in r if k.startswith("eval/") and k.endswith("/strict")
                        and k.count("/") == 2})
        curve.append({"step": r["step"], "tag": r["eval"],
                      **{n: {"strict": r[f"eval/{n}/strict"], "z": r.get(f"eval/{n}/paired_z", 0.0)}
                         for n in names}})
    return curve


def ends_gain(steps: list[dict], key: str) -> float:
    """Mean of `key` over the last FIRST_LAST steps minus over the first FIRST_LAST."""
    vals = [m[key] for m in steps if key in m]
    k = min(FIRST_LAST, len(vals) // 2) or 1
    return statistics.fmean(vals[-k:]) - statistics.fmean(vals[:k])


def run(control: str, seed: int, args, out_dir: str) -> dict:
    from omniroll.config import load_config
    from omniroll.train import Trainer
    from omniroll.train.report.tracking import read_jsonl

    cfg = load_config(run_config(args.config, control, seed, args))
    log = print if args.verbose else (lambda s: None)
    with Trainer(cfg, out_dir, log=log) as tr:
        tr.train()
    steps = [r for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl")) if "reward_mean" in r]
    evals = run_evaluations(out_dir)
    return {"proxy_gain": ends_gain(steps, "reward/proxy/mean"),
            "judge_partial_gain": ends_gain(steps, "reward/geneval/mean"),
            "train_minutes": sum(m["step_s"] for m in steps) / 60,
            "proxy_curve": [m.get("reward/proxy/mean") for m in steps],
            "judge_curve": [m.get("reward/geneval/mean") for m in steps],
            "strict_curve": [m.get("reward/strict/mean") for m in steps],
            "diversity_curve": [m.get("diversity_distance") for m in steps],
            "validation_curve": validation_curve(out_dir),
            "evaluation_curve": evaluation_curve(out_dir),
            "evaluations": {name: {"split": e["split"], "before": e["before"]["strict"], "after": e["after"]["strict"],
                                   "z": e["paired"]["overall"]["z"], "up": e["paired"]["overall"]["up"],
                                   "down": e["paired"]["overall"]["down"], **extra_objects(e)}
                            for name, e in evals.items()}}


def extra_failures(a: list[dict], b: list[dict]) -> tuple[int, int, float]:
    """The pictures failing for an extra object among `a` and among `b` (the same prompts and seeds), and the paired
    z of that count from `a` to `b` (pictures that newly fail so against those that no longer do)."""
    from omniroll.evaluation.paired import mcnemar_z, picture_key
    from omniroll.tasks.shapes.judge import fails_by_exclude

    was = {picture_key(p): fails_by_exclude(p["reasons"]) for p in a}
    now = {picture_key(p): fails_by_exclude(p["reasons"]) for p in b}
    new, gone = sum(now[k] and not was[k] for k in now), sum(was[k] and not now[k] for k in now)
    return sum(was.values()), sum(now.values()), mcnemar_z(new, gone)


def extra_objects(evaluation: dict) -> dict:
    """What the proxy, which counts badly, teaches: the pictures failing for an extra object before and after, with
    the paired z of that count (pictures that newly fail so against those that no longer do), and the share of
    pictures with more of a prompted shape than asked (the checker's `extra`, also where GenEval passes them) where
    the evaluation recorded it."""
    before, after, z = extra_failures(*evaluation["pictures"])
    out = {"extra_failures_before": before, "extra_failures_after": after, "extra_failures_z": z}
    if "extra_objects" in evaluation["before"] and "extra_objects" in evaluation["after"]:
        out.update(extra_before=evaluation["before"]["extra_objects"], extra_after=evaluation["after"]["extra_objects"])
    return out


def against_none(none_dir: str, run_dir: str) -> dict:
    """A control's effect itself: each evaluation after training paired picture by picture with the uncontrolled run
    (`none`) of the same training seed, at the same prompts and seeds. Per evaluation: the pictures flipped fail ->
    pass (`up`) and pass -> fail (`down`) from `none` to the control with McNemar's z, and the pictures failing for an
    extra object under each with the z of that count (`extra_failures_none`, `extra_failures`, `extra_failures_z`)."""
    from omniroll.evaluation.paired import paired

    base, other = run_evaluations(none_dir), run_evaluations(run_dir)
    out = {}
    for name in [n for n in other if n in base]:
        a, b = base[name]["pictures"][1], other[name]["pictures"][1]
        overall = paired(a, b)["overall"]  # refuses two evaluations of different pictures
        was, now, z = extra_failures(a, b)
        out[name] = {"up": overall["up"], "down": overall["down"], "z": overall["z"],
                     "extra_failures_none": was, "extra_failures": now, "extra_failures_z": z}
    return out


def none_run(root: str, seed: int, args) -> str | None:
    """`root/none-SEED` where it holds a finished `none` run at this comparison's settings (the same config, steps,
    seed and evaluation; the KL and data weights do not touch `none`), else None."""
    path = os.path.join(root, f"none-{seed}", "result.json")
    if not os.path.isdir(os.path.join(root, f"none-{seed}", "eval")):  # kept before runs kept their pictures
        return None
    with open(path) as f:
        kept = json.load(f)["settings"]
    same = ("config", "seed", "steps", "eval_seeds", "val_every", "val_pictures")
    want = run_settings("none", seed, args)
    if any(kept.get(k) != want[k] for k in same):
        print(f"[none seed {seed}] {path} ran at other settings: the controls are not paired with it",
              file=sys.stderr, flush=True)
        return None
    return os.path.dirname(path)


def run_settings(control: str, seed: int, args) -> dict:
    """What decides a run besides its code: kept beside its result, compared before a kept result is reused."""
    return {"control": control, "seed": seed, "config": os.path.abspath(args.config), "steps": args.steps,
            "kl_beta": args.kl_beta, "data_weight": args.data_weight, "eval_seeds": args.eval_seeds,
            "val_every": args.val_every, "val_pictures": args.val_pictures}


def kept_run(control: str, seed: int, args, out_dir: str) -> dict:
    """`run`'s result, read from `out_dir/result.json` when a run with the same settings finished there (with
    `--keep`, an interrupted comparison continues where it stopped), else run and written there."""
    path, settings = os.path.join(out_dir, "result.json"), run_settings(control, seed, args)
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        if kept.get("settings") == settings:
            print(f"[{control} seed {seed}] read from {path}", file=sys.stderr, flush=True)
            return kept["result"]
    print(f"[{control} seed {seed}]", file=sys.stderr, flush=True)
    result = run(control, seed, args, out_dir)
    with open(path + ".tmp", "w") as f:
        json.dump({"settings": settings, "result": result}, f)
    os.replace(path + ".tmp", path)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(HERE, "..", "examples", "shapes_demo.yaml"))
    p.add_argument("--controls", default=",".join(CONTROLS), help=f"a subset of {','.join(CONTROLS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each run by every control")
    p.add_argument("--steps", type=int, default=0, help="training steps per run (default: the config's)")
    p.add_argument("--kl-beta", type=float, default=0.003, help="the KL weight of kl_base, kl_ema, gardo "
                                                                "(default 0.003, AWM's)")
    p.add_argument("--data-weight", type=float, default=0.1, help="data's regulariser weight (default 0.1, untuned)")
    p.add_argument("--eval-seeds", type=int, default=0, help="pictures per prompt in the evaluations (default: the "
                                                               "config's)")
    p.add_argument("--val-every", type=int, default=0, help="steps between the task evaluations and validations "
                                                             "inside a run, the curves at fixed seeds (default 0: "
                                                             "before and after only)")
    p.add_argument("--val-pictures", type=int, default=2, help="validation pictures per training prompt (fixed "
                                                                "seeds; the proxy and the judge score each)")
    p.add_argument("--keep", default=None, help="keep each run's directory under this folder as CONTROL-SEED/, with "
                                               "its result.json: a rerun with the same settings reads a finished "
                                               "run's result instead of running it again")
    p.add_argument("--none-from", default=None, help="a --keep folder holding the `none` runs (NONE-SEED/) to pair "
                                                    "the controls with, when this run has none (default: this run's)")
    p.add_argument("--verbose", action="store_true", help="print every step line")
    args = p.parse_args(argv)
    controls = args.controls.split(",")
    if not set(controls) <= set(CONTROLS):
        p.error(f"--controls: a subset of {','.join(CONTROLS)}, got {args.controls!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    quiet_libraries()
    info = machine_info(1)
    record_loadavg(info, "loadavg_before")
    runs: dict = {c: {} for c in controls}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        for seed in seeds:  # every control's seed 0 first: a comparison stopped early has every control's first runs
            for control in controls:
                out_dir = os.path.join(root, f"{control}-{seed}")
                runs[control][seed] = kept_run(control, seed, args, out_dir)
        vs_none: dict = {}  # each control against the uncontrolled run of its seed, picture by picture
        for control in [c for c in controls if c != "none"]:
            for seed in seeds:
                none_dir = none_run(args.none_from or root, seed, args)
                run_dir = os.path.join(root, f"{control}-{seed}")
                if none_dir is not None and os.path.isdir(os.path.join(run_dir, "eval")):
                    vs_none.setdefault(control, {})[seed] = against_none(none_dir, run_dir)
    record_loadavg(info, "loadavg_after")

    print(f"{'control':9} {'proxy gain':>11} {'judge gain':>11}  " + "  ".join(
        f"{name:>28}" for name in next(iter(next(iter(runs.values())).values()))["evaluations"]))
    for control, by_seed in runs.items():
        for seed, r in by_seed.items():
            evals = "  ".join(f"{100 * e['before']:5.1f} -> {100 * e['after']:5.1f} % z {e['z']:+5.2f}"
                              for e in r["evaluations"].values())
            print(f"{control:9} {r['proxy_gain']:+11.3f} {r['judge_partial_gain']:+11.3f}  {evals}   (seed {seed})")
    for control, by_seed in runs.items():  # the pictures with extra objects, where the evaluations recorded them
        for seed, r in by_seed.items():
            extra = [f"{name} {e['extra_failures_before']} -> {e['extra_failures_after']} fail by one "
                     f"(z {e['extra_failures_z']:+.1f})" + (f", {100 * e['extra_before']:.1f} -> "
                                                           f"{100 * e['extra_after']:.1f} % show one" if
                                                           "extra_before" in e else "")
                     for name, e in r["evaluations"].items() if "extra_failures_before" in e]
            if extra:
                print(f"{control} seed {seed}, extra objects: " + "; ".join(extra))
    for control, by_seed in runs.items():  # the curves at fixed seeds, where a run has more than its two ends
        for seed, r in by_seed.items():
            if len(r.get("validation_curve", [])) > 2:
                print(f"{control} seed {seed}, at fixed seeds (z against the base): " + "; ".join(
                    f"step {v['step']} proxy {v['proxy']:.3f} ({v['proxy_z']:+.1f}) judge {v['judge']:.3f} "
                    f"({v['judge_z']:+.1f})" for v in r["validation_curve"]))
    for control, by_seed in vs_none.items():  # the control's own effect, at the same training seed
        for seed, by_eval in by_seed.items():
            print(f"{control} seed {seed} against none seed {seed} (after training, the same pictures): " + "; ".join(
                f"{name} {e['up']} up / {e['down']} down (z {e['z']:+.2f}), extra-object failures "
                f"{e['extra_failures_none']} -> {e['extra_failures']} (z {e['extra_failures_z']:+.2f})"
                for name, e in by_eval.items()))
    print(json.dumps({"benchmark": "reward_hacking", "machine": info, "kl_beta": args.kl_beta,
                      "data_weight": args.data_weight, "runs": runs, "against_none": vs_none}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
