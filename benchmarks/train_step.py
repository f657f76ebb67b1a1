"""One Flow-GRPO training step: omniroll's `Trainer` vs a flow_grpo-style sequential step.

(a) omniroll: rollout on a Ray replica through the AgentLoopManager with rewards streaming while generation runs, GRPO
    advantages, `train_on_batch` (recompute under the engine's batch-invariant mode), LoRA sync to the replica through
    `WeightSender` (Ray object refs), acks awaited. Phases from the trainer's own metrics: rollout, reward wait (after
    the last sample was generated), train, sync.
(b) sequential, flow_grpo's structure: one process, the same engine in-process generates the whole batch, then the
    reward scores every image, then the same `train_on_batch`, then the weights are loaded into the engine in-process.
Same model, prompts, seeds, sampling, reward, LoRA, optimizer and training work. `--reward-delay-ms` adds a wait per
sample to the reward (a remote scorer's latency), which (a) overlaps with generation and (b) cannot.
Both contenders alternate per repeat (after one warm-up step each); medians are reported; the last line is JSON.
(How the rollout loops themselves compare is benchmarks/rollout_throughput.py's subject.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from _common import machine_info, quiet_libraries, record_loadavg, train_step_config

def config(args, model: str):
    return train_step_config(args, model, {"r": {"fn": "benchmarks_reward:delayed_colour",
                                                 "kwargs": {"delay_ms": args.reward_delay_ms}}},
                             micro_batch_size=16, lora={"rank": 8, "alpha": 16})


class Sequential:
    """(b): everything in this process, one phase after the other."""

    def __init__(self, cfg, model: str):
        from omniroll import DiffusionEngine
        from omniroll.reward.scorers import build_scorer
        from omniroll.rollout.replica import resolve_engine_kwargs
        from omniroll.train.policy import Policy
        from omniroll.weights import WeightSender

        self.cfg, self.tc = cfg, cfg.trainer
        self.engine = DiffusionEngine.from_pretrained(model, **resolve_engine_kwargs(cfg.engine.engine_kwargs()))
        fn = cfg.reward.functions["r"]
        self.score = build_scorer(fn.fn, fn.kwargs)
        self.policy = Policy(model, "lora", self.tc.lora.rank, self.tc.lora.alpha, self.tc.lora.target_modules)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=self.tc.lr, weight_decay=0.0)
        self.sender = WeightSender([self.engine])
        self.version = 0

    def step(self, step: int) -> dict:
        from omniroll import GenerationRequest, SamplingParams
        from omniroll.reward import RewardSample
        from omniroll.sampling import derive_seed
        from omniroll.train import TrajectoryBatch, group_advantages
        from omniroll.train.algorithms import FlowGRPO, UpdatePlan
        from omniroll.train.update import train_on_batch
        from omniroll.train.version_store import VersionStore

        t0 = time.perf_counter()
        sp = SamplingParams(**self.cfg.sampling_params())
        prompts = self.tc.prompts
        reqs = [GenerationRequest(request_id=f"s{step}-{i}-{j}", prompt=p, sampling_params=sp,
                                  seed=derive_seed(0, step, f"prompt{i:05d}", j))
                for i, p in enumerate(prompts) for j in range(self.cfg.n)]
        outs = self.engine.generate(reqs)
        t1 = time.perf_counter()
        samples = [RewardSample(sample_id=r.request_id, image=o.diffusion_output.numpy(), prompt=r.prompt)
                   for r, o in zip(reqs, outs)]
        rewards = torch.tensor([float(s) for s in self.score(samples)])
        t2 = time.perf_counter()
        adv = group_advantages(rewards, [r.prompt for r in reqs], self.tc.global_std, self.tc.adv_clip_max)
        traj = TrajectoryBatch.from_outputs(outs)
        algo = FlowGRPO(self.cfg, self.policy.adapter)
        mbs = self.tc.micro_batch_size
        store = VersionStore(self.policy, 0)
        store.record(self.version)
        plan = UpdatePlan(step=step, seed=0, micro_batch_size=mbs, per_update=-(-len(traj) // mbs), store=store,
                          versions=torch.full((len(traj), traj.num_steps), self.version))
        anchors = algo.prepare(self.policy, traj, plan)
        stats = train_on_batch(self.policy, self.opt, algo, traj, adv.advantages, anchors, plan, num_inner_epochs=1,
                               max_grad_norm=1.0)
        t3 = time.perf_counter()
        self.version += 1
        self.sender.send(self.policy.weights_to_send(), version=self.version)
        t4 = time.perf_counter()
        assert stats.ratio_max_abs_dev == 0.0, stats
        return {"rollout_s": t1 - t0, "reward_wait_s": t2 - t1, "train_s": t3 - t2, "sync_s": t4 - t3,
                "step_s": t4 - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="denoising steps")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4, help="measured training steps per contender")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reward-delay-ms", type=float, default=20.0, help="wait per sample inside the reward")
    ap.add_argument("--cache-dir", default=".omniroll_cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_libraries()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                os.environ.get("PYTHONPATH", "")])
    import ray

    from _common import build_model
    from omniroll.train import Trainer

    info = machine_info(args.threads)
    model = build_model(args.cache_dir, "tiny")
    cfg = config(args, model)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    runs = {"omniroll": [], "sequential": []}
    out_dir = os.path.join(args.cache_dir, "bench-train-step")
    trainer = Trainer(cfg, out_dir, log=lambda s: None).start()
    seq = Sequential(cfg, model)
    try:
        trainer.step(1)  # warm-up (first LoRA install, first Ray calls)
        seq.step(1)
        for rep in range(args.repeats):
            order = ["omniroll", "sequential"] if rep % 2 == 0 else ["sequential", "omniroll"]
            for name in order:
                if name == "omniroll":
                    m = trainer.step(trainer.step_done + 1)
                    runs[name].append({k: m[k] for k in ("rollout_s", "reward_wait_s", "train_s", "sync_s",
                                                         "step_s")})
                else:
                    runs[name].append(seq.step(rep + 2))
                print(f"rep {rep} {name:10s} " + "  ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()),
                      flush=True)
    finally:
        trainer.close()
        seq.engine.shutdown()
        ray.shutdown()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    speedup = med["sequential"]["step_s"] / med["omniroll"]["step_s"]
    print(f"\n{args.prompts} prompts x {args.n}, {args.steps} steps, {args.size}px, CFG 4.5, window 3, LoRA r8, "
          f"reward delay {args.reward_delay_ms:g} ms/sample, {args.repeats} measured steps, medians (s)")
    print("| contender | rollout | reward wait | train | sync | step |\n|---|---:|---:|---:|---:|---:|")
    for name in ("omniroll", "sequential"):
        m = med[name]
        print(f"| {name} | {m['rollout_s']:.2f} | {m['reward_wait_s']:.2f} | {m['train_s']:.2f} | "
              f"{m['sync_s']:.3f} | {m['step_s']:.2f} |")
    print(f"speed-up (sequential / omniroll step): {speedup:.2f}x (goal >= 1.0)")
    record_loadavg(info, "loadavg_end")
    print(json.dumps({"benchmark": "train_step", "speedup_vs_sequential": round(speedup, 3),
                      "omniroll": {k: round(v, 4) for k, v in med["omniroll"].items()},
                      "sequential": {k: round(v, 4) for k, v in med["sequential"].items()},
                      "args": vars(args), "machine": info}))


if __name__ == "__main__":
    main()
