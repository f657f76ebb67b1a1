"""Tree rollouts against independent samples at equal denoiser forwards on the shapes world: the gradient-signal
meter (benchmarks/grad_signal.py) per contender, with the forwards each sample costs, and what an update whose
gradient reaches cosine 0.5 between two independent batches costs in forwards: do trees buy signal, or only compute?

For each contender the meter rolls out two batches of the same training prompts (seeds training never draws), takes
every prompt group's update direction with the algorithm's loss at the base weights, and fits the per-sample
signal-to-noise ratio s (samples for cosine 0.5: 1 / s). Forwards are counted, not modelled: the replicas' denoiser
forward rows per sample in the rollout (a tree's shared prefixes run once; a CFG step is 2 rows) and the trainer's
rows per sample in the gradient (a forward hook on its denoiser: the recompute and every loss term). A contender
is better per forward when `rollout_rows_for_cos50` (samples for cosine 0.5 x rollout rows per sample) is lower;
`all_rows_for_cos50` adds the update's rows. Contenders (each its shapes recipe, examples/shapes_<algorithm>.yaml):

- flow_grpo: 8 independent samples per prompt, Flow-GRPO's window.
- tree_2x4: tree_grpo's recipe, forks at steps 1 and 2 into 2 then 4 children, every step from the first fork trained.
- tree_2x4_forks: the same tree, only the fork steps trained (`trained_steps: forks`).
- tree_8: one fork at step 1 into 8 children (TempFlow-GRPO's one-level branching).
- dance_grpo: DanceGRPO's recipe (a group shares its initial noise, `dance_sde`).
- awm, nft: the forward-process algorithms' recipes, 8 independent samples per prompt from the CFG-free ODE (one
  row a step), the estimators that read signal on this world.
- awm_sde: AWM's recipe on tree_grpo's SDE window (steps 0-3, noise 0.8), a group sharing its initial noise (a
  fork at step 0: nothing shared but the start).
- awm_tree_2x4: AWM's recipe on tree_grpo's tree (the same window, forks at steps 1 and 2 into 2 then 4): do
  correlated leaves carry as much signal per forward as awm_sde's samples?

    python benchmarks/tree_equal_forwards.py                     # every training prompt, 5 sizes (~45 min here)
    python benchmarks/tree_equal_forwards.py --prompts 8 --sizes 8,32,64 --subsets 50    # a small budget

One reading per contender is one run: a few thousand samples for cosine 0.5 read from batches of at most a few
hundred has a wide error, so no contender is called better from one run. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

from _common import machine_info, quiet_libraries
from grad_signal import EXAMPLES, measure

#: a forward-process recipe's rollout with tree_grpo's SDE window (steps 0-3 at noise 0.8), where a tree can fork
SDE_WINDOW = ["algo.noise_level=0.8", "algo.sde_type=sde", "algo.sde_window_size=4", "algo.sde_window_range=[0,4]"]
#: name -> (recipe, overrides)
CONTENDERS = {
    "flow_grpo": ("shapes_flow_grpo.yaml", []),
    "tree_2x4": ("shapes_tree_grpo.yaml", []),
    "tree_2x4_forks": ("shapes_tree_grpo.yaml", ["trainer.algorithm_options.trained_steps=forks"]),
    "tree_8": ("shapes_tree_grpo.yaml", ["algo.tree.fork_steps=[1]", "algo.tree.widths=[8]"]),
    "dance_grpo": ("shapes_dance_grpo.yaml", []),
    "awm": ("shapes_awm.yaml", []),
    "nft": ("shapes_nft.yaml", []),
    "awm_sde": ("shapes_awm.yaml", SDE_WINDOW + ["algo.same_latent=true"]),
    "awm_tree_2x4": ("shapes_awm.yaml", SDE_WINDOW + ["algo.tree={fork_steps: [1, 2], widths: [2, 4]}"]),
}


def prompts_file(k: int, tmp: str) -> str | None:
    """The first k of the demo's training prompts in a file under tmp (None: every prompt, the recipe's file)."""
    if not k:
        return None
    with open(os.path.join(EXAMPLES, "shapes_eval_train.txt")) as f:
        prompts = [ln.strip() for ln in f if ln.strip()][:k]
    path = os.path.join(tmp, "prompts.txt")
    with open(path, "w") as f:
        f.write("\n".join(prompts) + "\n")
    return path


def row(name: str, rec: dict, base: dict | None) -> dict:
    need = rec["samples_for_cos50"]
    r_roll, r_train = rec["rollout_rows_per_sample"], rec["train_rows_per_sample"]
    out = {"contender": name, "samples_for_cos50": need, "rollout_rows_per_sample": r_roll,
           "train_rows_per_sample": r_train, "rollout_rows_for_cos50": need * r_roll if need else None,
           "all_rows_for_cos50": need * (r_roll + r_train) if need else None, "snr": rec["snr"],
           "largest_batch": rec["sizes"][-1]["samples"] if rec["sizes"] else None,
           "cos_at_largest": rec["sizes"][-1]["cos_mean"] if rec["sizes"] else None, "seconds": rec["seconds"]}
    for k in ("rollout_rows_for_cos50", "all_rows_for_cos50"):
        ref = base[k] if base else None
        out[f"{k}_vs_flow_grpo"] = out[k] / ref if out[k] and ref else None
    return out


def table(rows: list[dict]) -> str:
    def f(x, spec):
        width = int("".join(c for c in spec.split(",")[0].split(".")[0] if c.isdigit()))
        return format(x, spec) if x is not None else format("-", f">{width}")

    lines = [f"{'contender':<16} {'cos at':>7} {'samples':>8} {'rollout':>8} {'update':>8} {'rollout rows':>13} "
             f"{'all rows':>11} {'x flow':>7} {'x flow':>7}",
             f"{'':<16} {'largest':>7} {'cos .5':>8} {'rows/smp':>8} {'rows/smp':>8} {'for cos .5':>13} "
             f"{'for cos .5':>11} {'rollout':>7} {'all':>7}"]
    for r in rows:
        lines.append(f"{r['contender']:<16} {f(r['cos_at_largest'], '>+7.3f')} {f(r['samples_for_cos50'], '>8,.0f')} "
                     f"{r['rollout_rows_per_sample']:>8.1f} "
                     f"{r['train_rows_per_sample']:>8.1f} {f(r['rollout_rows_for_cos50'], '>13,.0f')} "
                     f"{f(r['all_rows_for_cos50'], '>11,.0f')} {f(r['rollout_rows_for_cos50_vs_flow_grpo'], '>7.2f')} "
                     f"{f(r['all_rows_for_cos50_vs_flow_grpo'], '>7.2f')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}")
    ap.add_argument("--prompts", type=int, default=0, help="the first K training prompts (0: all 37)")
    ap.add_argument("--sizes", default="8,48,96,192,296", help="batch sizes in samples (comma-separated)")
    ap.add_argument("--subsets", type=int, default=200, help="random prompt subsets per batch size")
    ap.add_argument("--override", action="append", default=[], help="dotted override for every contender")
    ap.add_argument("--seed", type=int, default=0, help="the subsets' seed")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in names if c not in CONTENDERS]
    if bad or not names:
        ap.error(f"--contenders: unknown {bad}, choose from {list(CONTENDERS)}")
    if args.prompts < 0:
        ap.error(f"--prompts must be >= 0, got {args.prompts}")
    quiet_libraries()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sizes = [int(x) for x in args.sizes.split(",")]
    t0 = time.time()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        # the meter rolls out every prompt of the file; prompts_per_step (training's) only has to fit in it
        extra = ([f"trainer.prompts_file={prompts_file(args.prompts, tmp)}", f"trainer.prompts_per_step={args.prompts}"]
                 if args.prompts else [])
        for name in names:
            recipe, over = CONTENDERS[name]
            rec = measure(os.path.join(EXAMPLES, recipe), over + extra + list(args.override), sizes, args.subsets,
                          args.seed, args.verbose)
            records.append({"contender": name, **rec})
            print(f"{name}: s = {rec['snr']:.2e}, {rec['rollout_rows_per_sample']:.1f} rollout rows per sample "
                  f"({rec['seconds']:.0f} s)", flush=True)
    base = next((row(n, rec, None) for n, rec in zip(names, records) if n == "flow_grpo"), None)
    rows = [row(n, rec, base) for n, rec in zip(names, records)]
    print(table(rows))
    out = {"benchmark": "tree_equal_forwards", "machine": machine_info(torch.get_num_threads()), "rows": rows,
           "prompts": args.prompts or "all", "sizes": sizes, "subsets": args.subsets, "records": records,
           "seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(out, default=lambda x: None if isinstance(x, float) and math.isinf(x) else str(x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
