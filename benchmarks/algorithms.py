"""The algorithms compared on the shapes world: GenEval's strict accuracy (overall and per category, on the training
prompts and on held-out ones) against rollout samples and against training seconds, for every `trainer.algorithm`,
at the same number of samples, over several seeds; and a flow_grpo-style in-process loop as the wall-clock baseline.

Contenders (all on examples/shapes_demo.yaml: the shipped shapes model, LoRA r16, lr 1e-3 for every contender, 6
prompts x 8 samples a step, the same prompts and seeds):
- flow_grpo: the synchronous trainer (SDE window of 3 steps in [0, 5], noise 0.8, clip 1e-4, no KL);
- flow_grpo_async: the same with max_staleness 1 (the next rollout during this step's update);
- grpo_guard: its reference defaults (clip_range 2e-6, the sde window above);
- dance_grpo: dance_sde with eta 0.3 (the reference's), every step but the last stochastic, groups sharing their
  initial noise, 60 % of the steps trained per sample;
- nft: CFG-off Euler ODE rollouts of the pipeline's 10 steps (the reference: a 10-step DPM2 solver), beta 1, 9
  training timesteps per sample, KL 1e-4, old-adapter decay type 1, global std;
- awm: CFG-off ODE rollouts, 6 training timesteps, ghuber p 0.25, KL 0.003;
- inprocess: flow_grpo's structure in one process (benchmarks/train_step.py's sequential loop: the engine in-process
  generates the batch, then the reward scores it, then the same update, then the weights are loaded): the wall-clock
  reference point for the trainer, synchronous and asynchronous.
Scaled to this machine (for all alike): 64 x 64 pictures, 10 sampling steps, 48 samples a step, 16 steps, lr 1e-3 for
a rank-16 LoRA (the references use 5-10x larger batches at lr 1e-5 to 3e-4). Accuracy is evaluated (the ODE with CFG
4.5 at fixed seeds, the same pictures for every contender) before training and every --eval-every steps. Training
seconds: the sum of the steps' wall times (evaluations not counted). The last line is JSON.

    python benchmarks/algorithms.py                                # every contender, seeds 0-2 (about 70 min here)
    python benchmarks/algorithms.py --contenders nft,awm --seeds 0 --steps 2   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import yaml

from _common import machine_info, quiet_libraries, record_loadavg
from shapes_learning import categories, mean_std, pct

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "examples", "shapes_demo.yaml")
FORWARD = {"noise_level", "sde_type", "sde_window_size", "sde_window_range", "same_latent"}
CONTENDERS = {
    "flow_grpo": {},
    "flow_grpo_async": {"trainer": {"max_staleness": 1}},
    "grpo_guard": {"trainer": {"algorithm": "grpo_guard"}},
    "dance_grpo": {"trainer": {"algorithm": "dance_grpo"},
                   "algo": {"sde_type": "dance_sde", "noise_level": 0.3, "same_latent": True,
                            "sde_window_size": None, "sde_window_range": None}},
    "nft": {"trainer": {"algorithm": "nft"}, "algo": None},
    "awm": {"trainer": {"algorithm": "awm"}, "algo": None},
    "inprocess": {},
}


def contender_config(name: str, args, seed: int, out_dir: str):
    """The demo's config with the contender's settings (its algorithm's reference defaults for clip_range and
    kl_beta: the demo's own values are dropped for every contender but flow_grpo)."""
    from omniroll.config import load_config

    with open(args.config) as f:
        raw = yaml.safe_load(f)
    raw = copy.deepcopy(raw)
    over = CONTENDERS[name]
    if name not in ("flow_grpo", "flow_grpo_async", "inprocess"):
        for k in ("clip_range", "kl_beta"):
            raw["trainer"].pop(k, None)
    if "algo" in over:
        if over["algo"] is None:
            raw["algo"] = {k: v for k, v in raw.get("algo", {}).items() if k not in FORWARD}
            for k in ("clip_range",):
                raw["trainer"].pop(k, None)
        else:
            raw["algo"] = {k: v for k, v in {**raw.get("algo", {}), **over["algo"]}.items() if v is not None}
    raw["trainer"].update(over.get("trainer", {}))
    raw["trainer"].update({"steps": args.steps, "val_every": args.eval_every, "max_staleness":
                           raw["trainer"].get("max_staleness", 0) if name == "flow_grpo_async" else 0,
                           "checkpoint_every": 0, "seed": seed})
    raw["seed"] = seed
    return load_config(raw)


def run_trainer(name: str, args, seed: int, out_dir: str) -> dict:
    from omniroll.train import FlowGRPOTrainer
    from omniroll.train.tracking import read_jsonl

    cfg = contender_config(name, args, seed, out_dir)
    with FlowGRPOTrainer(cfg, out_dir, log=print if args.verbose else (lambda s: None)) as tr:
        tr.train()
    recs = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    return curves([r for r in recs if "reward_mean" in r], [r for r in recs if "eval" in r])


def curves(steps: list[dict], evals: list[dict]) -> dict:
    seconds, samples = {0: 0.0}, {0: 0}
    for m in steps:
        seconds[m["step"]] = seconds[m["step"] - 1] + m["step_s"]
        samples[m["step"]] = samples[m["step"] - 1] + m["num_samples"]
    return {"evals": [{**e, "train_s": seconds[e["step"]], "samples": samples[e["step"]]} for e in evals],
            "reward": [m["reward_mean"] for m in steps]}


def run_inprocess(args, seed: int, out_dir: str) -> dict:
    """flow_grpo's structure in one process: rollout, then reward, then update, then load the weights."""
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
    from omniroll.evaluation.shapes import eval_sampling, evaluate
    from omniroll.models import resolve_model
    from omniroll.reward.scorers import RewardSample, build_scorer
    from omniroll.rollout.replica import resolve_engine_kwargs
    from omniroll.sampling.seeds import batch_prompt_uid, derive_seed, prompt_order_seed
    from omniroll.tasks.shapes.splits import prompts_of
    from omniroll.train import TrajectoryBatch
    from omniroll.train.algorithms import FlowGRPO, UpdatePlan
    from omniroll.train.policy import Policy
    from omniroll.train.update import train_on_batch
    from omniroll.train.versions import VersionStore
    from omniroll.weights import WeightSender

    cfg = contender_config("inprocess", args, seed, out_dir)
    tc, model = cfg.trainer, resolve_model(cfg.engine.model)
    torch.set_num_threads(tc.num_threads or 1)
    engine = DiffusionEngine.from_pretrained(model, **resolve_engine_kwargs(cfg.engine.engine_kwargs()))
    policy = Policy(model, tc.mode, tc.lora.rank, tc.lora.alpha, tc.lora.target_modules, seed=tc.seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=tc.lr, betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
    algo = FlowGRPO(cfg, policy.adapter)
    score = build_scorer("shapes")
    sender = WeightSender([engine])
    store = VersionStore(policy, 0)
    prompts = tc.all_prompts()
    evals, steps = [], []

    def evaluation(step: int) -> None:
        rec = {"step": step, "eval": "inprocess"}
        for split in tc.evaluation.splits:
            ev = evaluate(engine, prompts_of(split), tc.evaluation.seeds, eval_sampling(cfg), cfg.val_kwargs.seed)
            rec.update(ev.report.flat(f"eval/{os.path.splitext(os.path.basename(split))[0]}"))
        evals.append(rec)

    evaluation(0)
    for step in range(1, tc.steps + 1):
        t0 = time.time()
        g = torch.Generator().manual_seed(prompt_order_seed(tc.seed, step))
        picks = torch.randperm(len(prompts), generator=g)[:tc.prompts_per_step].tolist()
        sp = SamplingParams(**{**cfg.sampling_params(), **algo.sampling_overrides(step)})
        reqs = [GenerationRequest(request_id=f"s{step}-{i}-{j}", prompt=prompts[i], sampling_params=sp,
                                  seed=derive_seed(cfg.seed, step, batch_prompt_uid(i), j))
                for i in picks for j in range(cfg.n)]
        outs = engine.generate(reqs)
        got = score([RewardSample(sample_id=r.request_id, image=o.diffusion_output.numpy(), prompt=r.prompt)
                     for r, o in zip(reqs, outs)])
        rewards = torch.tensor([float(x["score"]) if isinstance(x, dict) else float(x) for x in got])
        adv = algo.advantages(rewards, [r.prompt for r in reqs])
        traj = TrajectoryBatch.from_outputs(outs)
        store.record(step - 1)
        plan = UpdatePlan(step=step, seed=tc.seed, micro_batch_size=tc.micro_batch_size,
                          per_update=-(-len(traj) // tc.micro_batch_size), store=store,
                          versions=torch.full((len(traj), traj.num_steps), step - 1))
        algo.prepare(policy, traj, plan)
        stats = train_on_batch(policy, opt, algo, traj, adv.advantages, plan, num_inner_epochs=tc.num_inner_epochs,
                               max_grad_norm=tc.max_grad_norm)
        sender.send(policy.weights_to_send(), version=step)
        assert stats.ratio_max_abs_dev == 0.0, stats
        steps.append({"step": step, "step_s": time.time() - t0, "num_samples": len(reqs),
                      "reward_mean": float(rewards.mean())})
        if args.verbose:
            print(f"inprocess step {step}: reward {rewards.mean():.4f}  {steps[-1]['step_s']:.1f}s", flush=True)
        if step % args.eval_every == 0 or step == tc.steps:
            evaluation(step)
    engine.shutdown()
    return curves(steps, evals)


# ------------------------------------------------------------------------------------------------ the summary
def time_to(evals: list[dict], key: str, target: float) -> float | None:
    """Training seconds at which `key` first reaches `target` (linear between evaluations); None: never."""
    pts = [(e["train_s"], e[key]) for e in evals]
    if pts[0][1] >= target:
        return 0.0
    for (t0, y0), (t1, y1) in zip(pts, pts[1:]):
        if y1 >= target:
            return t0 + (t1 - t0) * (target - y0) / max(y1 - y0, 1e-12)
    return None


def summarise(runs: dict, splits: list[str]) -> dict:
    out = {}
    for name, by_seed in runs.items():
        rec: dict = {}
        for split in splits:
            key = f"eval/{split}/strict"
            first = [r["evals"][0][key] for r in by_seed.values()]
            last = [r["evals"][-1][key] for r in by_seed.values()]
            cats = categories(by_seed, split)
            rec[split] = {"before": mean_std(first), "after": mean_std(last),
                          "gain": mean_std([b - a for a, b in zip(first, last)]),
                          "best": mean_std([max(e[key] for e in r["evals"]) for r in by_seed.values()]),
                          "categories_after": {c: mean_std([r["evals"][-1][f"eval/{split}/{c}/strict"]
                                                            for r in by_seed.values()]) for c in cats},
                          "seconds_to": {str(t): [time_to(r["evals"], key, t) for r in by_seed.values()]
                                         for t in (0.8, 0.9)}}
        rec["train_s"] = mean_std([r["evals"][-1]["train_s"] for r in by_seed.values()])
        rec["samples"] = by_seed[next(iter(by_seed))]["evals"][-1]["samples"]
        out[name] = rec
    return out


def reached(xs: list) -> str:
    got = [x for x in xs if x is not None]
    return f"{len(got)}/{len(xs)}" + (f" {statistics.fmean(got):.0f}s" if got else "")


def plot(runs: dict, splits: list[str], path: str) -> None:
    """Overall strict accuracy against samples (top) and training seconds (bottom), per split; a line per
    contender (the mean over seeds), each seed faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(splits), figsize=(6 * len(splits), 7.6), dpi=100, squeeze=False)
    for col, split in enumerate(splits):
        key = f"eval/{split}/strict"
        for row, x in enumerate(("samples", "train_s")):
            ax = axes[row][col]
            for i, (name, by_seed) in enumerate(runs.items()):
                for r in by_seed.values():
                    ax.plot([e[x] for e in r["evals"]], [100 * e[key] for e in r["evals"]], color=f"C{i}",
                            alpha=0.25, lw=1)
                n = min(len(r["evals"]) for r in by_seed.values())
                xs = [statistics.fmean(r["evals"][k][x] for r in by_seed.values()) for k in range(n)]
                ys = [100 * statistics.fmean(r["evals"][k][key] for r in by_seed.values()) for k in range(n)]
                ax.plot(xs, ys, color=f"C{i}", marker="o", ms=3, lw=2, label=name)
            ax.set_title(f"{split} prompts")
            ax.set_xlabel("rollout samples" if x == "samples" else "training seconds (steps' wall time)")
            ax.set_ylabel("strict accuracy %")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Algorithms on the shapes world (omniroll): GenEval strict accuracy, mean of seeds (faint: each)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"a subset of {','.join(CONTENDERS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each run by every contender")
    p.add_argument("--steps", type=int, default=16, help="training steps per run (48 samples each; default 16)")
    p.add_argument("--eval-every", type=int, default=8, help="steps between evaluations (default 8)")
    p.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "algorithms.png"))
    p.add_argument("--keep", default=None, help="keep each run's directory under this folder as NAME-SEED/")
    p.add_argument("--partial", default=None, help="append each finished run's curves to this JSON-lines file")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    names = args.contenders.split(",")
    if not names or not set(names) <= set(CONTENDERS):
        p.error(f"--contenders: a subset of {','.join(CONTENDERS)}, got {args.contenders!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    quiet_libraries()
    info = machine_info(1)
    record_loadavg(info, "loadavg_before")
    runs: dict = {n: {} for n in names}
    with tempfile.TemporaryDirectory(prefix="omniroll-algorithms-") as scratch:
        for seed in seeds:
            for name in names:
                out = os.path.join(args.keep or scratch, f"{name}-{seed}")
                t = time.time()
                r = run_inprocess(args, seed, out) if name == "inprocess" else run_trainer(name, args, seed, out)
                runs[name][seed] = r
                first, last = r["evals"][0], r["evals"][-1]
                line = "  ".join(f"{k.split('/')[1]} {100 * first[k]:.1f} -> {100 * last[k]:.1f} %"
                                 for k in first if k.startswith("eval/") and k.count("/") == 2
                                 and k.endswith("/strict"))
                print(f"seed {seed} {name:<16} {line}  ({last['train_s']:.0f} training s, {last['samples']} "
                      f"samples, {time.time() - t:.0f} s in all)", flush=True)
                if args.partial:
                    with open(args.partial, "a") as f:
                        f.write(json.dumps({"name": name, "seed": seed, **r}) + "\n")
    record_loadavg(info, "loadavg_after")
    splits = sorted({k.split("/")[1] for by_seed in runs.values() for r in by_seed.values() for k in r["evals"][0]
                     if k.startswith("eval/") and k.count("/") == 2})
    res = summarise(runs, splits)
    for split in splits:
        print(f"\n{split} prompts, strict accuracy % (mean +- std over {len(seeds)} seed(s)); reached 80 / 90 %: "
              f"runs that did, mean training seconds")
        print(f"{'contender':<16} {'before':>13} {'after':>13} {'gain':>13} {'best eval':>13} {'to 80 %':>10} "
              f"{'to 90 %':>10} {'train s':>8}")
        for n, rec in res.items():
            s = rec[split]
            print(f"{n:<16} {pct(s['before']):>13} {pct(s['after']):>13} {pct(s['gain']):>13} {pct(s['best']):>13} "
                  f"{reached(s['seconds_to']['0.8']):>10} {reached(s['seconds_to']['0.9']):>10} "
                  f"{rec['train_s']['mean']:>8.0f}")
        cats = list(next(iter(res.values()))[split]["categories_after"])
        print(f"{'after, per cat.':<16} " + " ".join(f"{c[:12]:>14}" for c in cats))
        for n, rec in res.items():
            print(f"{n:<16} " + " ".join(f"{pct(rec[split]['categories_after'][c]):>14}" for c in cats))
    ratios = {}
    if "inprocess" in res:
        base = res["inprocess"]["train_s"]["mean"]
        for n in ("flow_grpo", "flow_grpo_async"):
            if n in res:
                ratios[n] = base / res[n]["train_s"]["mean"]
                print(f"\n{n}: the in-process loop needs {ratios[n]:.2f}x its training seconds for the same "
                      f"{res[n]['samples']} samples")
    plot(runs, splits, args.plot)
    print(f"curves -> {os.path.relpath(args.plot)}")
    print(json.dumps({"contenders": res, "inprocess_time_ratio": ratios, "seeds": seeds, "steps": args.steps,
                      "machine": info, "curves": {n: {s: [{k: v for k, v in e.items() if k in ("step", "train_s",
                                                                                                 "samples")
                                                          or (k.startswith("eval/") and k.count("/") == 2)}
                                                         for e in r["evals"]] for s, r in by_seed.items()}
                                                  for n, by_seed in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
