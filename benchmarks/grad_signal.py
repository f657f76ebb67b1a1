"""Is a training config's update signal or noise, before any training? The cosine between the update directions of two
independent batches (the same prompts, other seeds) at several batch sizes, at the base model (or, with --resume, at
a run's checkpoint: how much of the signal training leaves).

For a training config (its model, algorithm, rollout, reward and trainer settings), the trainer's own pieces roll out
two batches of every training prompt (n samples each, seeds that training never draws), compute every prompt group's
update direction with the algorithm's loss at the current weights (`omniroll.train.grad_signal.group_gradients`: the
trainer's recompute, the ratio exactly 1), and for each batch size N (samples) average, over random subsets of
N / n prompts, the cosine between batch A's summed direction and batch B's. If a batch's gradient is N samples of
signal mu plus noise of variance sigma^2 each, E cos = N s / (1 + N s) with s = |mu|^2 / sigma^2 the per-sample
signal-to-noise ratio; the fitted s says how many samples an update needs for cosine 0.5 (1 / s).

A second curve, from the same gradients, pairs batch A's directions on one random half of the prompts with batch B's
on the **other** half ("other prompts"): there a prompt's own direction (what helps that prompt and no other) counts as
noise, and only what the prompts share counts as signal. That is what the trainer's meter (`grad_cos` in every step's
metrics) reads, since its two halves are different prompt groups of one step; it is also the part of an update that
can carry to prompts never trained on. Sizes above half the prompts' samples have no such reading.

    python benchmarks/grad_signal.py --config examples/shapes_flow_grpo.yaml          # one config (~3-5 min here)
    python benchmarks/grad_signal.py --config examples/shapes_flow_grpo.yaml --override algo.noise_level=0.5
    python benchmarks/grad_signal.py --all                # every examples/shapes_<algorithm>.yaml, one table
    python benchmarks/grad_signal.py --config examples/shapes_video_demo.yaml --resume RUN/checkpoints/step_000004

Prints a table per config and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from typing import Optional

import torch

from _common import emit_record, machine_info, quiet_libraries

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
#: the rollout steps of the two batches: far from any training step, so their seeds are ones training never draws
BATCH_STEPS = (1_000_001, 1_000_002)


class ForwardRows:
    """Counts the rows a module's forwards run while entered (a forward hook: `rows`, `calls`)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.rows, self.calls, self.handle = module, 0, 0, None

    def _hook(self, module, args, kwargs, output) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        self.rows += int(x.shape[0]) if isinstance(x, torch.Tensor) else 0
        self.calls += 1

    def __enter__(self) -> "ForwardRows":
        self.handle = self.module.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def replica_forward_rows(replicas) -> int:
    """The denoiser forward rows every replica has run (a CFG sample's step is 2 rows)."""
    import ray

    return sum(s["forward_rows"] for s in ray.get([r.stats.remote() for r in replicas]))


def measure(config_path: str, overrides: list[str], sizes: list[int], subsets: int, seed: int,
            verbose: bool, resume: Optional[str] = None) -> dict:
    """One config's curve: {"sizes": [{"samples", "cos_mean", "cos_std", "cos_se"}], "snr", "samples_for_cos50",
    "seconds", "rollout_rows_per_sample" (the replicas' denoiser forward rows per sample of the two batches: a tree's
    shared prefixes counted once), "train_rows_per_sample" (the trainer's denoiser forward rows per sample of the
    update's gradient: the algorithm's recompute and loss terms), ...}. resume: a checkpoint of a run of this config,
    whose weights are measured instead of the base model's."""
    from omniroll.agent_loop.batch import prompt_batch
    from omniroll.config import load_config
    from omniroll.sampling.seeds import batch_prompt_uid
    from omniroll.train import Trainer
    from omniroll.train.algorithms import UpdatePlan
    from omniroll.train.grad_signal import fit_snr, group_gradients, samples_for_cos
    from omniroll.train.staleness import step_versions

    cfg = load_config(config_path, overrides=overrides + ["trainer.evaluation=null", "trainer.logger=[jsonl]"])
    t0 = time.time()
    log = print if verbose else (lambda s: None)
    grads = []
    rolled, rollout_rows, train_rows = 0, 0, 0  # samples rolled out, their forward rows, the gradients' rows
    with tempfile.TemporaryDirectory() as tmp, Trainer(cfg, tmp, log=log, resume=resume) as tr:
        prompts = tr.prompts
        for b, step in enumerate(BATCH_STEPS):
            meta = {"global_steps": step, "rollout_seed": cfg.seed or 0}
            overrides_sp = tr.algorithm.sampling_overrides(1)
            if overrides_sp:
                meta["sampling_params"] = overrides_sp
            batch = prompt_batch(prompts, cfg.n, batch_prompt_uid, data_source="train", meta_info=meta)
            before = replica_forward_rows(tr.replicas)
            out = asyncio.run(tr.manager.generate_sequences_async(batch))
            rollout_rows += replica_forward_rows(tr.replicas) - before
            rolled += len(out)
            W = int(out.batch["rollout_log_probs"].shape[1]) if "rollout_log_probs" in out.batch.keys() else 0
            versions = step_versions(out, W)
            rewards = out.batch["rm_scores"][:, 0].float()
            uids = list(out.non_tensor_batch["uid"])
            adv = tr.algorithm.advantages(rewards, uids, out)  # tree_grpo and reward.aggregation gdpo read out
            rows = tr.algorithm.rows(out, tr.policy.adapter)
            # the update's own draws (a forward-process algorithm's training timesteps and noise, seeded by the step)
            # differ between the batches as they would between two training steps: with one plan for both, a
            # prompt's two gradients would share their noise and read it as signal
            plan = UpdatePlan(step=1 + b, seed=cfg.trainer.seed, micro_batch_size=cfg.trainer.micro_batch_size,
                              versions=versions, store=tr.store)
            with ForwardRows(tr.policy.denoiser) as counted:
                grads.append(group_gradients(tr.policy, tr.algorithm, rows, adv.advantages, uids, plan))
            train_rows += counted.rows
            log(f"batch {b}: {len(rows)} samples, reward {float(rewards.mean()):.3f}, {adv.tied_groups} tied groups")
    common = sorted(set(grads[0]) & set(grads[1]))
    curve = cosine_curve(grads, common, cfg.n, sizes, subsets, random.Random(seed), other_prompts=False)
    other = cosine_curve(grads, common, cfg.n, sizes, subsets, random.Random(seed), other_prompts=True)
    one_batch = cosine_curve([grads[0], grads[0]], common, cfg.n, sizes, subsets, random.Random(seed),
                             other_prompts=True)
    s = fit_snr([c["samples"] for c in curve], [c["cos_mean"] for c in curve])
    s_other = fit_snr([c["samples"] for c in other], [c["cos_mean"] for c in other]) if other else 0.0
    return {"config": os.path.relpath(config_path), "overrides": overrides, "resume": resume,
            "algorithm": cfg.trainer.algorithm,
            "n": cfg.n, "prompts": len(common), "sizes": curve, "snr": s,
            "samples_for_cos50": samples_for_cos(s) if s > 0 else None,
            "sizes_other_prompts": other, "sizes_other_prompts_one_batch": one_batch, "snr_other_prompts": s_other,
            "samples_for_cos50_other_prompts": samples_for_cos(s_other) if s_other > 0 else None,
            "seconds": time.time() - t0,
            "rollout_rows_per_sample": rollout_rows / max(rolled, 1),
            "train_rows_per_sample": train_rows / max(rolled, 1)}


def cosine_curve(grads: list, common: list, n: int, sizes: list[int], subsets: int, rng: random.Random,
                 other_prompts: bool) -> list[dict]:
    """The mean cosine between batch A's summed direction and batch B's at each size (samples per batch), over random
    prompt subsets: the same prompts in both batches, or (other_prompts) disjoint halves of one random draw."""
    curve = []
    for samples in sizes:
        k = max(1, samples // n)
        need = 2 * k if other_prompts else k
        if need > len(common):
            continue
        cos = []
        for _ in range(subsets if need < len(common) or other_prompts else 1):
            pick = rng.sample(common, need)
            a = sum(grads[0][u] for u in pick[:k])
            b = sum(grads[1][u] for u in pick[-k:])
            cos.append(float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30)))
        m = sum(cos) / len(cos)
        sd = (sum((c - m) ** 2 for c in cos) / max(len(cos) - 1, 1)) ** 0.5
        curve.append({"samples": k * n, "cos_mean": m, "cos_std": sd, "subsets": len(cos)})
    return curve


def table(rec: dict) -> str:
    at = f" at {rec['resume']}" if rec.get("resume") else ""
    head = (f"{rec['config']}{at} {' '.join(rec['overrides'])} ({rec['algorithm']}, n={rec['n']}, "
            f"{rec['prompts']} prompts)")
    lines = [head, f"{'samples':>8} {'cos mean':>9} {'+- std':>7}  {'fit':>7}"]
    for c in rec["sizes"]:
        fit = c["samples"] * rec["snr"] / (1 + c["samples"] * rec["snr"])
        lines.append(f"{c['samples']:>8} {c['cos_mean']:>+9.3f} {c['cos_std']:>7.3f}  {fit:>7.3f}")
    need = rec["samples_for_cos50"]
    lines.append(f"per-sample signal-to-noise s = {rec['snr']:.2e}: "
                 + (f"about {need:,.0f} samples per update for cosine 0.5" if need else "no signal detected")
                 + f"  ({rec['seconds']:.0f} s)")
    if rec["sizes_other_prompts"]:
        other = "  ".join(f"{c['samples']}: {c['cos_mean']:+.3f}" for c in rec["sizes_other_prompts"])
        need = rec["samples_for_cos50_other_prompts"]
        lines.append(f"other prompts (what the trainer's meter reads): {other}; "
                     + (f"about {need:,.0f} samples for cosine 0.5" if need else "no signal detected"))
        one = "  ".join(f"{c['samples']}: {c['cos_mean']:+.3f}" for c in rec["sizes_other_prompts_one_batch"])
        lines.append(f"other prompts of one batch (a step's two halves): {one}")
    lines.append(f"denoiser forward rows per sample: {rec['rollout_rows_per_sample']:.1f} in the rollout, "
                 f"{rec['train_rows_per_sample']:.1f} in the update's gradient")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=[], help="a training config (repeatable)")
    ap.add_argument("--all", action="store_true", help="every examples/shapes_<algorithm>.yaml")
    ap.add_argument("--override", action="append", default=[], help="dotted override for every config (repeatable)")
    ap.add_argument("--sizes", default="8,16,48,96,192,296", help="batch sizes in samples (comma-separated)")
    ap.add_argument("--subsets", type=int, default=200, help="random prompt subsets per batch size")
    ap.add_argument("--seed", type=int, default=0, help="the subsets' seed")
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    ap.add_argument("--resume", default=None, help="a checkpoint of a run of the config: measure its weights, not the "
                    "base model's (how much signal is left after training)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.all:
        from omniroll.config.algorithms import ALGORITHMS

        args.config += [os.path.join(EXAMPLES, f"shapes_{name}.yaml") for name in ALGORITHMS]
    configs = list(args.config)
    if not configs:
        ap.error("give --config or --all")
    quiet_libraries()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sizes = [int(x) for x in args.sizes.split(",")]
    records = []
    for path in configs:
        rec = measure(path, list(args.override), sizes, args.subsets, args.seed, args.verbose, args.resume)
        print(table(rec), flush=True)
        records.append(rec)
    out = {"benchmark": "grad_signal", "machine": machine_info(torch.get_num_threads()), "records": records,
           "date": time.strftime("%Y-%m-%d")}
    emit_record(out, args.out, default=lambda x: None if isinstance(x, float) and math.isinf(x) else str(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
