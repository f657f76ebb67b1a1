"""MARBLE's measurement on the shapes world: with several rewards, how often does one reward's own update direction
point against the total's, under `reward.aggregation: sum` and under `gdpo`?

MARBLE reports that under a weighted sum the worst reward's gradient points against the total in 80 % of
mini-batches. Here the rewards are the six GenEval categories as six reward functions (`fn: shapes` with
`kwargs: {category: ...}`: partial credit on that category's samples, a constant elsewhere), and, as a second set,
the same six plus `jpeg_compressibility` (flow_grpo's compressibility reward: smaller files score higher, a reward
that can pull against drawing the objects).

The trainer's pieces (a training config, default `examples/shapes_flow_grpo.yaml`) roll out the training prompts once
(n samples each, seeds training never draws) and score every function. At the base model, with the ratio exactly 1
and no KL term, Flow-GRPO's update direction is linear in the advantages: d(A) = sum_i A_i v_i, with v_i one
sample's gradient (`omniroll.train.grad_signal.group_gradients` with advantage 1, each sample alone). So one
backward per sample gives the Gram matrix G = V V^T, and every reading is then cheap: a "step" draws
`prompts_per_step` prompt groups at random, computes the total's advantages and each function's own
(`omniroll.train.advantages.component_advantages`, normalised as the aggregation normalises the total: what
`trainer.signal_components` reads in training) on that step's rows, and the cosine
cos_k = A_k^T G A / sqrt(A_k^T G A_k  A^T G A). A function with no direction in a step (it tied in every group drawn:
e.g. no prompt of its category) gives no reading there, as in the trainer.

    python benchmarks/reward_components.py                     # the recipe's 37 prompts x 8 samples (minutes)
    python benchmarks/reward_components.py --n 4 --per-category 2    # 12 prompts x 4 (the small budget)

Prints a table (per function set, aggregation and function: readings, share negative, mean cosine) and ends with one
JSON line. What it measures is the base model's batch, read at many random steps; the trainer's meter reads the same
quantity on each step's own batch while the weights move.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

import torch
import yaml

from _common import emit_record, machine_info, quiet_libraries

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "examples", "shapes_flow_grpo.yaml")
#: the rollout step of the batch: far from any training step, so its seeds are ones training never draws
BATCH_STEP = 1_000_003
AGGREGATIONS = (("sum", False), ("sum global_std", True), ("gdpo", False))


def functions() -> dict:
    """The reward functions scored (the sets below pick from them; their weights here are unused)."""
    from omniroll.tasks.shapes.grammar import TAGS

    fns = {tag: {"fn": "shapes", "kwargs": {"category": tag}} for tag in TAGS}
    fns["jpeg"] = {"fn": "jpeg_compressibility", "weight": 0.0}
    return fns


def function_sets(jpeg_weight: float) -> dict:
    from omniroll.tasks.shapes.grammar import TAGS

    cats = {tag: 1.0 for tag in TAGS}
    return {"categories": cats, f"categories + jpeg x{jpeg_weight:g}": {**cats, "jpeg": jpeg_weight}}


def pick_prompts(prompts: list[str], per_category: int | None) -> list[str]:
    """The first `per_category` prompts of each GenEval category, in the file's order (None: all)."""
    from omniroll.tasks.shapes.grammar import parse_prompt

    if per_category is None:
        return list(prompts)
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        tag = parse_prompt(p).tag
        if seen.get(tag, 0) < per_category:
            seen[tag] = seen.get(tag, 0) + 1
            out.append(p)
    return out


def roll_out_and_differentiate(config: str, n: int, per_category: int | None, verbose: bool) -> dict:
    """One batch of the training prompts (`per_category` of each category, None: all): its uids, each function's
    score per row, the Gram matrix of the samples' gradients (float64 [B, B]), and seconds."""
    from omniroll.agent_loop.batch import prompt_batch
    from omniroll.config import load_config
    from omniroll.sampling.seeds import batch_prompt_uid
    from omniroll.train import Trainer
    from omniroll.train.advantages import batch_components
    from omniroll.train.algorithms import UpdatePlan
    from omniroll.train.grad_signal import group_gradients
    from omniroll.train.staleness import step_versions

    with open(config) as f:
        raw = yaml.safe_load(f)
    raw["reward"]["functions"] = functions()
    raw["n"] = n
    prompts = pick_prompts(load_config(raw).trainer.all_prompts(), per_category)
    raw["trainer"].update(prompts=prompts, prompts_file=None, prompts_per_step=min(len(prompts),
                                                                                  raw["trainer"]["prompts_per_step"]))
    raw["trainer"].update(evaluation=None, logger=["jsonl"], kl_beta=0.0)  # at the base the KL's gradient is 0
    cfg = load_config(raw)
    log = print if verbose else (lambda s: None)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, Trainer(cfg, tmp, log=log) as tr:
        meta = {"global_steps": BATCH_STEP, "rollout_seed": cfg.seed or 0}
        sp = tr.algorithm.sampling_overrides(1)
        if sp:
            meta["sampling_params"] = sp
        batch = prompt_batch(tr.prompts, cfg.n, batch_prompt_uid, data_source="train", meta_info=meta)
        out = asyncio.run(tr.manager.generate_sequences_async(batch))
        t_roll = time.time() - t0
        uids = list(out.non_tensor_batch["uid"])
        comps = batch_components(out, list(cfg.reward.functions))
        W = int(out.batch["rollout_log_probs"].shape[1])
        rows = tr.algorithm.rows(out, tr.policy.adapter)
        plan = UpdatePlan(step=1, seed=cfg.trainer.seed, micro_batch_size=cfg.trainer.micro_batch_size,
                          versions=step_versions(out, W), store=tr.store)
        B = len(uids)
        grads = group_gradients(tr.policy, tr.algorithm, rows, torch.ones(B), list(range(B)), plan)
        V = torch.stack([grads[i] for i in range(B)])
        gram = V @ V.T
    log(f"{B} samples: rollout {t_roll:.0f} s, gradients {time.time() - t0 - t_roll:.0f} s")
    from omniroll.tasks.shapes.grammar import parse_prompt

    per_cat: dict[str, int] = {}
    for p in prompts:
        per_cat[parse_prompt(p).tag] = per_cat.get(parse_prompt(p).tag, 0) + 1
    return {"uids": uids, "components": comps, "gram": gram, "samples": B, "prompts": len(set(uids)),
            "prompts_per_category": per_cat,
            "rollout_s": t_roll, "seconds": time.time() - t0, "trainable": int(V.shape[1])}


def readings(batch: dict, weights: dict, aggregation: str, global_std: bool, per_step: int, count: int,
             seed: int, adv_clip_max: float = 5.0) -> dict:
    """{function: [cosines]} over `count` random steps of `per_step` prompt groups."""
    from omniroll.reward.aggregation import gdpo_scores
    from omniroll.train.advantages import component_advantages, group_advantages

    groups = list(dict.fromkeys(batch["uids"]))
    rng = random.Random(seed)
    out: dict[str, list[float]] = {k: [] for k in weights}
    for _ in range(count):
        pick = set(rng.sample(groups, per_step))
        idx = [i for i, u in enumerate(batch["uids"]) if u in pick]
        uids = [batch["uids"][i] for i in idx]
        comps = {k: [batch["components"][k][i] for i in idx] for k in weights}
        if aggregation == "gdpo":
            total = torch.from_numpy(gdpo_scores(comps, weights, uids).scores).clamp(-adv_clip_max, adv_clip_max)
        else:
            r = sum(w * torch.tensor(comps[k], dtype=torch.float64) for k, w in weights.items())
            total = group_advantages(r, uids, global_std, adv_clip_max).advantages
        parts = component_advantages(comps, weights, uids, aggregation, global_std, adv_clip_max)
        g = batch["gram"][idx][:, idx]
        a = total.double()
        aa = float(a @ g @ a)
        for k, p in parts.items():
            p = p.double()
            pp = float(p @ g @ p)
            if pp > 0 and aa > 0:
                out[k].append(float(p @ g @ a) / (pp * aa) ** 0.5)
    return out


def spreads(batch: dict) -> dict:
    """Per function: the prompt groups where it varies, and its mean within-group (population) std over them."""
    import numpy as np

    groups = list(dict.fromkeys(batch["uids"]))
    out = {}
    for k, values in batch["components"].items():
        sds = [float(np.std([values[i] for i, u in enumerate(batch["uids"]) if u == g])) for g in groups]
        varying = [sd for sd in sds if sd > 0]
        out[k] = {"varying_groups": len(varying), "groups": len(groups),
                  "group_std": sum(varying) / len(varying) if varying else 0.0}
    return out


def summarise(cos: dict) -> dict:
    return {k: {"readings": len(v), "neg_share": sum(c < 0 for c in v) / len(v) if v else None,
                "cos_mean": sum(v) / len(v) if v else None, "cos_min": min(v) if v else None} for k, v in cos.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG, help="a training config (its model, algorithm, rollout, prompts)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--per-category", type=int, default=None, help="the first K training prompts of each category "
                    "(default: all the config's)")
    ap.add_argument("--per-step", type=int, default=None, help="prompt groups per step (default: the config's "
                    "trainer.prompts_per_step)")
    ap.add_argument("--readings", type=int, default=1000, help="random steps read per aggregation")
    ap.add_argument("--jpeg-weight", type=float, default=1.0, help="jpeg_compressibility's weight in the second set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    quiet_libraries()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with open(args.config) as f:
        per_step = args.per_step or int(yaml.safe_load(f)["trainer"].get("prompts_per_step", 6))
    batch = roll_out_and_differentiate(args.config, args.n, args.per_category, args.verbose)
    results = []
    print(f"{batch['samples']} samples ({batch['prompts']} prompts x {args.n}), steps of {per_step} prompt groups, "
          f"{args.readings} steps each ({batch['seconds']:.0f} s to roll out and differentiate)")
    spread = spreads(batch)
    print("within-group spread: " + ", ".join(f"{k} {v['group_std']:.2g} in {v['varying_groups']}/{v['groups']} "
                                              f"groups" for k, v in spread.items()))
    print(f"{'functions':<22} {'aggregation':<15} {'function':<14} {'readings':>8} {'cos < 0':>8} {'mean cos':>9} "
          f"{'min cos':>8}")
    for set_name, weights in function_sets(args.jpeg_weight).items():
        for agg, global_std in AGGREGATIONS:
            s = summarise(readings(batch, weights, agg.split()[0], global_std, per_step, args.readings, args.seed))
            results.append({"functions": set_name, "aggregation": agg, "per_function": s})
            for k, v in s.items():
                if v["readings"]:
                    print(f"{set_name:<22} {agg:<15} {k:<14} {v['readings']:>8} {v['neg_share']:>8.1%} "
                          f"{v['cos_mean']:>+9.3f} {v['cos_min']:>+8.3f}")
    out = {"benchmark": "reward_components", "config": os.path.relpath(args.config), "n": args.n,
           "per_category": args.per_category,
           "samples": batch["samples"], "prompts": batch["prompts"], "per_step": per_step,
           "readings": args.readings, "seconds": batch["seconds"], "rollout_s": batch["rollout_s"],
           "mean_reward": {k: sum(v) / len(v) for k, v in batch["components"].items()}, "spread": spread,
           "prompts_per_category": batch["prompts_per_category"],
           "results": results, "machine": machine_info(torch.get_num_threads()), "date": time.strftime("%Y-%m-%d")}
    emit_record(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
