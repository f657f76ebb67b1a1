"""Each training algorithm on the shapes world, judged in the regime it trains: the paired comparison with the base
model at the same evaluation seeds (pictures flipped fail -> pass and pass -> fail, McNemar's z), on the training
prompts and on held-out ones, over several training seeds, with the wall-clock time.

Contenders: every algorithm's own shapes recipe, `examples/shapes_<algorithm>.yaml` (the shipped shapes model, LoRA,
GenEval's partial credit as the reward), at its own number of steps or `--steps`. Each run's trainer evaluates
before the first step and after the last (`trainer.evaluation`: first in the regime the algorithm trains, CFG off for
NFT and AWM, then at the pipeline's CFG 4.5 beside it), so every after-evaluation is paired with the before one at
the same prompts and seeds. For a CFG-free algorithm the table adds its CFG-free model after training against the
guided base (at the prompts and seeds both drew: DiffusionNFT's claim that RL makes guidance unnecessary).
`--model` starts every run from another model (a guidance-distilled one: `make shapes-model-distilled`); the CFG-free
model after training is then also paired with `--guided-base` (default: the shipped model) at its own CFG scale,
evaluated once at the same prompts and seeds. |z| < 2 reads "no detectable change", whatever the means say.
Training minutes: the steps' wall time (startup and evaluations not counted). Prints a table per evaluation, writes
the plot (`--plot`), and ends with one JSON line.

    python benchmarks/algorithms.py                                      # every recipe, training seeds 0-2
    python benchmarks/algorithms.py --algorithms nft,flow_grpo --steps 24 --seeds 0-2
    python benchmarks/algorithms.py --algorithms nft --seeds 0 --steps 2 --eval-seeds 1   # a check that it runs
    python benchmarks/algorithms.py --algorithms awm --model out/shapes-distilled/checkpoint   # RL after distillation
    python benchmarks/algorithms.py --algorithms dance_grpo --label mixgrpo --override algo.sde_window_size=2 \
        --override 'algo.sde_window_range=[0,5]' --override trainer.window_schedule=progressive \
        --override trainer.window_advance_every=25 --override trainer.algorithm_options.timestep_fraction=1.0
                                       # a variant of one recipe (MixGRPO's window), named in the tables and records
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _common import machine_info, picture_summary, quiet_libraries, record_loadavg, run_evaluations
from shapes_learning import parse_seeds

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def recipe(name: str) -> str:
    return os.path.join(ROOT, "examples", f"shapes_{name}.yaml")


def recipe_steps(name: str) -> int:
    """The training steps of `name`'s recipe."""
    import yaml

    with open(recipe(name)) as f:
        return int(yaml.safe_load(f)["trainer"]["steps"])


def eval_overrides(args) -> list[str]:
    return ([f"trainer.evaluation.seeds={args.eval_seeds}", f"trainer.evaluation.beside_seeds={args.eval_seeds}"]
            if args.eval_seeds else [])


def guided_base(name: str, args, out_dir: str) -> dict[str, list[dict]]:
    """`--guided-base` evaluated at its own (the validation sampling's) CFG scale on `name`'s evaluation splits, at
    the recipe's evaluation seeds (the trainer's: the same pictures' noise): per split, its pictures. Written to
    `out_dir/<split>_cfg<G>/` and read back from there when present."""
    from omniroll.cli.common import preflight
    from omniroll.cli.eval import evaluate_model
    from omniroll.config import load_config
    from omniroll.tasks.shapes.splits import prompts_of
    from omniroll.train.report.task_eval import evaluation_name

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        cfg = load_config(recipe(name), overrides=[f"engine.model={args.guided_base}", *eval_overrides(args)])
        ev = cfg.trainer.evaluation
        scale = float(cfg.sampling_params(validate=True)["guidance_scale"])
        out = {}
        for split in ev.splits:
            d = os.path.join(out_dir, evaluation_name(split, scale))
            if not os.path.exists(os.path.join(d, "eval.json")):
                prompts = prompts_of(split)
                evaluate_model(cfg, preflight(cfg, prompts), prompts, ev.seeds, None, d, guidance=scale)
            with open(os.path.join(d, "eval.json")) as f:
                out[split] = json.load(f)["pictures"]
        return out
    finally:
        os.chdir(cwd)


def versus(base: list[dict], evaluation: dict, guidance: float) -> dict:
    """The pictures `evaluation` drew after training paired with `base`'s, at the prompts and seeds both drew (an
    evaluation at fewer seeds per prompt draws a subset of another's)."""
    from omniroll.evaluation.paired import common_pictures, paired

    base, after = common_pictures(base, evaluation["pictures"][1])
    return {"before": picture_summary(base), "after": picture_summary(after), "split": evaluation["split"],
            "guidance_scale": guidance, "paired": paired(base, after)}


def run(name: str, args, seed: int, out_dir: str, base_dir: str) -> dict:
    """One training run of `name`'s recipe; returns its evaluations (before / after, per evaluation name: overall,
    categories, paired), training seconds and samples."""
    from omniroll.config import load_config
    from omniroll.train import Trainer
    from omniroll.train.report.task_eval import evaluation_name
    from omniroll.train.report.tracking import read_jsonl

    overrides = [f"seed={seed}", f"trainer.seed={seed}", "trainer.checkpoint_every=0", "trainer.val_every=0",
                 "trainer.log_images_every=0", "trainer.logger=[jsonl]", *eval_overrides(args)]
    if args.steps:
        overrides.append(f"trainer.steps={args.steps}")
    if args.model:
        overrides.append(f"engine.model={args.model}")
    overrides += args.override
    cwd = os.getcwd()
    os.chdir(ROOT)  # the recipes name their prompt files relative to the repository
    try:
        cfg = load_config(recipe(name), overrides=overrides)
        with Trainer(cfg, out_dir, log=print if args.verbose else (lambda s: None)) as tr:
            tr.train()
        guidances = cfg.evaluation_guidances()
    finally:
        os.chdir(cwd)
    steps = [m for m in read_jsonl(os.path.join(out_dir, "metrics.jsonl")) if "reward_mean" in m]
    evals = run_evaluations(out_dir)
    if guidances[0] <= 1.0 < max(guidances):  # CFG-free training: its model CFG-free against the guided base
        for off in [e for e in list(evals) if evals[e]["guidance_scale"] == guidances[0]]:
            guided = evals.get(off.rsplit("_cfg", 1)[0] + f"_cfg{max(guidances):g}")
            if guided is not None:
                evals[f"{off}_vs_guided_base"] = versus(guided["pictures"][0], evals[off], guidances[0])
    if args.model and guidances[0] <= 1.0:  # another start: its CFG-free model against --guided-base
        for split, base in guided_base(name, args, base_dir).items():
            off = evaluation_name(split, guidances[0])
            if off in evals:
                evals[f"{off}_vs_guided_base"] = versus(base, evals[off], guidances[0])
    for e in evals.values():
        e.pop("pictures", None)
    return {"evals": evals, "train_s": sum(m["step_s"] for m in steps), "samples": sum(m["num_samples"] for m in steps),
            "steps": len(steps), "grad_cos_mean": statistics.fmean(m["grad_cos"] for m in steps if "grad_cos" in m)
            if any("grad_cos" in m for m in steps) else None}


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def tables(runs: dict) -> tuple[str, dict]:
    """The printed tables (one per evaluation) and the JSON summary."""
    lines, out = [], {}
    names = sorted({e for by_seed in runs.values() for r in by_seed.values() for e in r["evals"]})
    for evaluation in names:
        lines.append(f"\n{evaluation}: strict accuracy % (mean +- std over training seeds), the paired z of each seed "
                     f"against the base at the same seeds")
        lines.append(f"{'algorithm':<12} {'before':>7} {'after':>13} {'gain':>13} {'z per seed':>22} "
                     f"{'up / down':>12} {'verdicts':>22} {'train min':>10}")
        out[evaluation] = {}
        for algo, by_seed in runs.items():
            rs = [r for r in by_seed.values() if evaluation in r["evals"]]
            if not rs:
                continue
            ev = [r["evals"][evaluation] for r in rs]
            before = statistics.fmean(e["before"]["strict"] for e in ev)
            after = mean_std([e["after"]["strict"] for e in ev])
            gain = mean_std([e["after"]["strict"] - e["before"]["strict"] for e in ev])
            zs = [e["paired"]["overall"]["z"] for e in ev]
            ups = [e["paired"]["overall"]["up"] for e in ev]
            downs = [e["paired"]["overall"]["down"] for e in ev]
            verdicts = [e["paired"]["overall"]["verdict"] for e in ev]
            minutes = mean_std([r["train_s"] / 60 for r in rs])
            short = {"detectably better": "+", "detectably worse": "-", "no detectable change": "="}
            lines.append(f"{algo:<12} {100 * before:>7.1f} {100 * after[0]:>7.1f} +- {100 * after[1]:>3.1f} "
                         f"{100 * gain[0]:>+7.1f} +- {100 * gain[1]:>3.1f} "
                         f"{' '.join(f'{z:+.1f}' for z in zs):>22} {sum(ups):>5} / {sum(downs):<5} "
                         f"{' '.join(short[v] for v in verdicts):>22} {minutes[0]:>6.1f}")
            out[evaluation][algo] = {"before": before, "after": after, "gain": gain, "z": zs, "up": ups,
                                     "down": downs, "verdicts": verdicts, "train_minutes": minutes,
                                     "categories_gain": {t: statistics.fmean(e["after"]["categories"][t]
                                                                             - e["before"]["categories"][t]
                                                                             for e in ev)
                                                         for t in ev[0]["after"]["categories"]}}
    lines.append("\nverdicts: + detectably better (z >= 2), - detectably worse (z <= -2), = no detectable change")
    return "\n".join(lines), out


def plot(summary_: dict, path: str) -> None:
    """The paired z of every (algorithm, training seed) per evaluation, the band |z| < 2 shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [e for e in summary_ if not e.endswith("_vs_guided_base")]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), dpi=100, squeeze=False)
    for ax, evaluation in zip(axes[0], names):
        algos = list(summary_[evaluation])
        for i, algo in enumerate(algos):
            zs = summary_[evaluation][algo]["z"]
            ax.scatter([i] * len(zs), zs, color=f"C{i}", zorder=3)
        ax.axhspan(-2, 2, color="grey", alpha=0.2, label="|z| < 2: no detectable change")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(range(len(algos)))
        ax.set_xticklabels(algos, rotation=30, fontsize=8)
        ax.set_title(evaluation, fontsize=9)
        ax.set_ylabel("paired z after vs before (one dot per training seed)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    from omniroll.config.algorithms import ALGORITHMS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="a subset of the registered algorithms")
    p.add_argument("--seeds", default="0-2", help="training seeds: 0, 0,2 or 0-2")
    p.add_argument("--steps", type=int, default=None, help="training steps of every run (default: each recipe's)")
    p.add_argument("--eval-seeds", type=int, default=None, help="evaluation pictures per prompt (default: each "
                                                                "recipe's trainer.evaluation.seeds)")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "algorithms_paired.png"),
                   help="the paired z of every run (default: docs/algorithms_paired.png; docs/algorithms.png is the "
                        "former unpaired comparison's figure)")
    p.add_argument("--keep", default=None, help="keep each run's directory under this folder as NAME-SEED/")
    p.add_argument("--partial", default=None, help="append each finished run to this JSON-lines file; a run already "
                                                   "in it (the same algorithm, seed, --steps, --eval-seeds and "
                                                   "--model) is read from it, not run again: an interrupted "
                                                   "comparison continues where it stopped")
    p.add_argument("--summarize", default=None, metavar="PARTIAL", help="run nothing: summarize the runs a --partial "
                                                                       "file holds (several invocations may append "
                                                                       "to one; a variant's runs under its label, "
                                                                       "with --label only those)")
    p.add_argument("--model", default=None, help="the model every run starts from (default: each recipe's, the "
                                                 "shipped shapes model), e.g. out/shapes-distilled/checkpoint")
    p.add_argument("--guided-base", default="shapes", help="with --model: the model the CFG-free model after "
                                                           "training is also paired with, at its own CFG scale "
                                                           "(default: the shipped shapes model)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override applied to every run after its recipe (repeatable): a variant")
    p.add_argument("--label", default=None, help="the name of the (single) algorithm's runs in the tables, the plot "
                                                 "and --partial records (default: the algorithm's): a variant")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    algos = args.algorithms.split(",")
    unknown = [a for a in algos if a not in ALGORITHMS]
    if unknown:
        p.error(f"--algorithms: unknown {unknown}; registered: {','.join(ALGORITHMS)}")
    if args.label is not None and len(algos) != 1:
        p.error(f"--label names one algorithm's runs; --algorithms gives {len(algos)}")
    bad = [o for o in args.override if "=" not in o]
    if bad:
        p.error(f"--override: expected KEY=VALUE, got {bad}")
    seeds = parse_seeds(args.seeds)
    if args.summarize:
        runs = {}
        with open(args.summarize) as f:
            for line in f:
                rec = json.loads(line)
                if rec["algorithm"] in algos and args.label in (None, rec.get("label")):
                    runs.setdefault(rec.get("label") or rec["algorithm"], {})[rec["seed"]] = rec
        return report(runs, sorted({s for r in runs.values() for s in r}), args, {"summarized": args.summarize})
    quiet_libraries()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    info = machine_info(1)
    record_loadavg(info, "loadavg_before")
    name = {a: args.label or a for a in algos}  # the runs' name in the tables and records
    runs: dict = {name[a]: {} for a in algos}
    done = finished_runs(args)
    with tempfile.TemporaryDirectory(prefix="omniroll-algorithms-") as scratch:
        for seed in seeds:
            for algo in algos:
                if (algo, seed) in done:
                    runs[name[algo]][seed] = done[algo, seed]
                    print(f"seed {seed} {name[algo]:<11} read from {args.partial}", flush=True)
                    continue
                out = os.path.abspath(os.path.join(args.keep or scratch, f"{name[algo]}-{seed}"))
                t = time.time()
                r = runs[name[algo]][seed] = run(algo, args, seed, out, os.path.join(args.keep or scratch,
                                                                                     "guided_base"))
                line = "  ".join(f"{e} {100 * v['before']['strict']:.1f} -> {100 * v['after']['strict']:.1f} "
                                 f"(z {v['paired']['overall']['z']:+.1f})" for e, v in r["evals"].items())
                print(f"seed {seed} {name[algo]:<11} {line}  ({r['train_s'] / 60:.1f} training min, {r['samples']} "
                      f"samples, {(time.time() - t) / 60:.1f} min in all)", flush=True)
                if args.partial:
                    with open(args.partial, "a") as f:
                        f.write(json.dumps({"algorithm": algo, "seed": seed, **run_settings(args), **r}) + "\n")
    record_loadavg(info, "loadavg_after")
    return report(runs, seeds, args, info)


def run_settings(args) -> dict:
    """What a --partial record keeps of the settings that decide a run (besides its algorithm and seed); a variant's
    label and overrides only when given (records without them are the recipe's own runs)."""
    variant = {"label": args.label, "overrides": args.override} if args.label or args.override else {}
    return {"steps": args.steps, "eval_seeds": args.eval_seeds, "model": args.model, **variant}


def finished_runs(args) -> dict:
    """{(algorithm, seed): record} of the runs `--partial` already holds with this invocation's settings (records
    written before the settings were kept count as the defaults')."""
    if not args.partial or not os.path.exists(args.partial):
        return {}
    want, done = run_settings(args), {}
    with open(args.partial) as f:
        for line in f:
            rec = json.loads(line)
            # a record's "steps" is the steps its run took (run's result): without --steps, the recipe's
            wanted = {**want, "steps": args.steps or recipe_steps(rec["algorithm"])}
            if all(rec.get(k) == v for k, v in wanted.items()) and not (set(rec) & {"label", "overrides"}) - set(want):
                done[rec["algorithm"], rec["seed"]] = {k: v for k, v in rec.items() if k not in ("algorithm", "seed",
                                                                                                   *want)}
    return done


def report(runs: dict, seeds: list[int], args, info: dict) -> int:
    """The tables, the plot and the JSON line of finished runs."""
    text, res = tables(runs)
    print(text)
    plot(res, args.plot)
    print(f"plot -> {os.path.relpath(args.plot)}")
    print(json.dumps({"benchmark": "algorithms", "summary": res, "seeds": seeds, "steps": args.steps,
                      "model": args.model, "machine": info, "date": time.strftime("%Y-%m-%d"),
                      "runs": {a: {s: {k: v for k, v in r.items() if k not in ("evals", "algorithm", "seed")}
                                   for s, r in by_seed.items()} for a, by_seed in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
