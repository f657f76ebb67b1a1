"""Which noise decides the reward: the share of a sample's reward variance set by its initial noise and by each SDE
step's noise, at the base model, beside the most signal a likelihood-ratio gradient can draw from that noise.

A GRPO-family update is sum_k A * grad log p(x_k+1 | x_k) over the K recorded SDE steps: each term is the step's
noise eps_k (a D-dimensional standard normal, D the latent's size) over its standard deviation, seen through the
denoiser, weighted by the advantage A. With respect to the steps' means (the noise's own coordinates) its per-sample
signal-to-noise ratio is s = sum_k |Cov(A, eps_k)|^2 / (Var(A) * K * D), and since the K * D coordinates of the
noise are independent standard normals, sum_k |Cov(A, eps_k)|^2 <= Var(A | the initial noise) <= Var(A) (Bessel's
inequality): s <= 1 / (K * D), at least K * D samples for an update of cosine 0.5, and more where the initial noise
decides part of the reward (no recorded step's log-prob sees it) or the reward is not linear in the noise. The meter
(`benchmarks/grad_signal.py`) reads s in the weights' coordinates; this script measures the shares the bound leaves
open.

For each step k of `--steps`, the training prompts are rolled out at the base model as groups of `--leaves`
samples that share their initial noise and every step's noise but step k's (step k the only SDE step, noise level
and the rest of the sampling as in `--config`; after it the ODE): `algo.same_latent` for step 0, a one-level tree
forking at step k (`algo.tree`) after it. `--groups` such groups per prompt (each its own initial noise) give:

- within (V_k): the reward's variance inside a group, what step k's noise decides (the groups' sample variances);
- between: the variance of the group means less V_k / leaves, what the initial noise decides;
- tied: the share of groups whose leaves all score the same (nothing for that step's noise to credit).

Then `--config` itself (independent samples, its own window and noise) is rolled out `--groups` times per prompt:
the reward's variance inside a prompt group there is what its advantages are standardised by. Shares are ratios of
the per-prompt means (pooled over the prompts). Rewards: the config's trained reward (the weighted sum).

    python benchmarks/reward_variance_steps.py                                  # Flow-GRPO's recipe, steps 0-4
    python benchmarks/reward_variance_steps.py --prompts 4 --groups 2 --steps 0,2 --leaves 4      # a check

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import torch

from _common import emit_record, machine_info, quiet_libraries

HERE = os.path.dirname(os.path.abspath(__file__))
#: rollout steps far from any training step, so their seeds are ones training never draws
FIRST_BATCH_STEP = 2_000_001


def rollout(config_path: str, overrides: list[str], prompts_limit: int, groups: int, log) -> dict:
    """Roll the config's training prompts out `groups` times (one group of n per prompt each time):
    {"rewards": {prompt: [[group's rewards], ...]}, "latent_numel": D, "samples": ..., "window_size": K}."""
    from omniroll.agent_loop.batch import prompt_batch
    from omniroll.config import load_config
    from omniroll.sampling.seeds import batch_prompt_uid
    from omniroll.train import Trainer

    cfg = load_config(config_path, overrides=overrides + ["trainer.evaluation=null", "trainer.logger=[jsonl]"])
    rewards: dict[str, list[list[float]]] = {}
    numel, samples = 0, 0
    with tempfile.TemporaryDirectory() as tmp, Trainer(cfg, tmp, log=lambda s: None) as tr:
        prompts = tr.prompts[:prompts_limit] if prompts_limit else tr.prompts
        for g in range(groups):
            meta = {"global_steps": FIRST_BATCH_STEP + g, "rollout_seed": cfg.seed or 0}
            batch = prompt_batch(prompts, cfg.n, batch_prompt_uid, data_source="train", meta_info=meta)
            out = asyncio.run(tr.manager.generate_sequences_async(batch))
            r = out.batch["rm_scores"][:, 0].float().tolist()
            raw = list(out.non_tensor_batch["raw_prompt"])
            uids = list(out.non_tensor_batch["uid"])
            groups_of: dict[str, tuple[str, list[float]]] = {}  # uid -> (prompt, the group's rewards)
            for u, p, x in zip(uids, raw, r):
                groups_of.setdefault(u, (str(p), []))[1].append(x)
            for p, xs in groups_of.values():
                rewards.setdefault(p, []).append(xs)
            if "all_latents" in out.batch.keys():
                numel = int(out.batch["all_latents"][0, 0].numel())
            samples += len(r)
            log(f"  {os.path.basename(config_path)} {' '.join(overrides)}: batch {g + 1}/{groups}, {len(r)} samples, "
                f"reward {sum(r) / len(r):.3f}")
    return {"rewards": rewards, "latent_numel": numel, "samples": samples,
            "window_size": int(cfg.algo.sde_window_size or 1)}


def decompose(rewards: dict[str, list[list[float]]]) -> dict:
    """Per-prompt within-group variance, between-group variance (less within / leaves) and total, pooled as means
    over the prompts; the share of groups whose rewards all tie."""
    within, between, tied, groups = [], [], 0, 0
    for gs in rewards.values():
        w = [statistics.variance(g) for g in gs if len(g) > 1]
        vw = sum(w) / len(w)
        means = [sum(g) / len(g) for g in gs]
        leaves = statistics.mean(len(g) for g in gs)
        vb = statistics.variance(means) - vw / leaves if len(means) > 1 else 0.0
        within.append(vw)
        between.append(max(vb, 0.0))
        tied += sum(1 for g in gs if max(g) == min(g))
        groups += len(gs)
    vw, vb = statistics.mean(within), statistics.mean(between)
    return {"within": vw, "between": vb, "total": vw + vb, "within_share": vw / max(vw + vb, 1e-12),
            "tied_share": tied / max(groups, 1), "groups": groups}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "..", "examples", "shapes_flow_grpo.yaml"),
                    help="the training recipe whose sampling is measured (default: Flow-GRPO's shapes recipe)")
    ap.add_argument("--steps", default="0,1,2,3,4", help="the SDE steps whose noise is measured one at a time")
    ap.add_argument("--leaves", type=int, default=8, help="samples per group (sharing all but one step's noise)")
    ap.add_argument("--groups", type=int, default=4, help="groups per prompt, each its own initial noise")
    ap.add_argument("--prompts", type=int, default=0, help="the first N training prompts (default: all)")
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    quiet_libraries()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    log = print if args.verbose else (lambda s: None)
    steps = [int(s) for s in args.steps.split(",")]
    t0 = time.time()
    rows, numel = [], 0
    for k in steps:
        common = [f"n={args.leaves}", "algo.sde_window_size=1", f"algo.sde_window_range=[{k},{k + 1}]"]
        if k == 0:
            over = common + ["algo.same_latent=true"]
        else:
            over = common + ["trainer.algorithm=tree_grpo", f"algo.tree.fork_steps=[{k}]",
                             f"algo.tree.widths=[{args.leaves}]"]
        rec = rollout(args.config, over, args.prompts, args.groups, log)
        numel = numel or rec["latent_numel"]
        rows.append({"step": k, **decompose(rec["rewards"]), "samples": rec["samples"]})
        print(f"step {k}: within {rows[-1]['within']:.4f}, between {rows[-1]['between']:.4f}, "
              f"tied {rows[-1]['tied_share']:.0%} ({time.time() - t0:.0f} s)", flush=True)
    base = rollout(args.config, [], args.prompts, args.groups, log)
    recipe = decompose(base["rewards"])
    numel = numel or base["latent_numel"]

    K = base["window_size"]  # the recipe's recorded steps
    bound = 1.0 / (K * numel)  # Bessel: in the steps' means' coordinates

    print(f"\nWhich noise decides the reward ({os.path.relpath(args.config)}, {len(base['rewards'])} prompts, "
          f"{args.groups} groups of {args.leaves} per prompt and step; the latent has D = {numel} values)")
    print(f"{'noise':<22} {'within V_k':>10} {'between':>9} {'V_k share':>9} {'tied groups':>11}")
    for r in rows:
        print(f"{'step ' + str(r['step']) + ' alone':<22} {r['within']:>10.4f} {r['between']:>9.4f} "
              f"{r['within_share']:>9.1%} {r['tied_share']:>11.0%}")
    print(f"{'the recipe (all noise)':<22} {recipe['within']:>10.4f} {'':>9} {'':>9} {recipe['tied_share']:>11.0%}")
    print(f"in the steps' means' coordinates a sample carries at most s = 1 / (K * D) = 1 / ({K} * {numel}) = "
          f"{bound:.2e}: at least {K * numel:,} samples per update for cosine 0.5 at the recipe's window of {K}, "
          f"more where the initial noise decides part of the reward ('between') or it is not linear in the noise")
    out = {"benchmark": "reward_variance_steps", "config": os.path.relpath(args.config), "leaves": args.leaves,
           "groups": args.groups, "prompts": len(base["rewards"]), "latent_numel": numel, "steps": rows,
           "recipe": recipe, "window_size": K, "snr_bound": bound, "samples_for_cos50_at_least": K * numel,
           "seconds": time.time() - t0,
           "machine": machine_info(torch.get_num_threads()), "date": time.strftime("%Y-%m-%d")}
    emit_record(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
