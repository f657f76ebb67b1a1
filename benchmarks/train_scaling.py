"""The update phase of one Flow-GRPO step at N = 1 (in the trainer's process) and N = 2 (two `TrainerRank` Ray actors,
gloo all-reduce): the same batch, the same starting weights and optimizer state, each repeat from that state.

One batch is rolled out once (a world_size-1 trainer's replica, rewards, advantages); then, alternating, (1) its
`prepare` + `train_on_batch` in this process and (2) `RankGroup.update` on two ranks (shards of whole prompt groups,
rows sent through the object store, rank 0's weights back). Reported per N: the median update time, its ratio to
N = 1, the largest weight difference to N = 1 after the update, and `ratio_max_abs_dev` (0.0: exact at every rank).
On a small shared CPU no speed-up is expected (two ranks share the cores the single process had): this is a
correctness run with the overhead measured. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

from _common import machine_info, quiet_libraries, record_loadavg, train_step_config

def config(args, model: str, world_size: int):
    return train_step_config(args, model, {"colour": {"fn": "prompt_colour"}},
                             micro_batch_size=args.micro_batch_size, mode=args.mode, num_threads=args.threads,
                             world_size=world_size, resources={"num_cpus": 0})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="denoising steps")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--repeats", type=int, default=3, help="measured updates per N")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (trainer and each rank)")
    ap.add_argument("--cache-dir", default=".omniroll_cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_libraries()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ray

    from _common import build_model
    from omniroll.agent_loop.batch import prompt_batch
    from omniroll.sampling.seeds import batch_prompt_uid
    from omniroll.train import Trainer
    from omniroll.train.algorithms import UpdatePlan
    from omniroll.train.parallel.distributed import RankGroup, adopt_weights
    from omniroll.train.update import train_on_batch
    from omniroll.train.staleness import step_versions

    info = machine_info(args.threads)
    model = build_model(args.cache_dir, "tiny")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    trainer = Trainer(config(args, model, 1), os.path.join(args.cache_dir, "bench-train-scaling"),
                              log=lambda s: None).start()
    ranks = None
    times: dict[int, list[float]] = {1: [], 2: []}
    devs: dict[int, float] = {1: 0.0, 2: 0.0}
    diff = 0.0
    try:
        # 1. One batch: rollout, rewards, advantages on the whole batch, the trajectory rows.
        tc, algo, policy = trainer.tc, trainer.algorithm, trainer.policy
        batch = prompt_batch(trainer.prompts, args.n, batch_prompt_uid, data_source="train",
                             meta_info={"global_steps": 1, "rollout_seed": 0})
        out = asyncio.run(trainer.manager.generate_sequences_async(batch))
        adv = algo.advantages(out.batch["rm_scores"][:, 0].float(), list(out.non_tensor_batch["uid"]))
        traj = algo.rows(out, policy.adapter)
        plan = UpdatePlan(step=1, seed=tc.seed, micro_batch_size=tc.micro_batch_size,
                          per_update=-(-len(traj) // tc.micro_batch_size), store=trainer.store,
                          versions=step_versions(out, traj.num_steps))
        start_w = {k: p.detach().clone() for k, p in policy.named_parameters()}
        start_opt = trainer.optimizer.state_dict()
        # 2. The two ranks, from the same state.
        ranks = RankGroup(config(args, model, 2), trainer.cluster.model, os.path.join(trainer.out_dir, "rank_state"),
                          log=lambda s: None)
        ranks.start(policy, trainer.optimizer, algo, trainer.store)

        def restore():
            adopt_weights(policy, start_w)
            trainer.optimizer.load_state_dict(start_opt)

        for rep in range(args.repeats):
            for N in ((1, 2) if rep % 2 == 0 else (2, 1)):
                if N == 1:
                    restore()
                    t0 = time.perf_counter()
                    anchors = algo.prepare(policy, traj, plan)
                    stats = train_on_batch(policy, trainer.optimizer, algo, traj, adv.advantages, anchors, plan,
                                           num_inner_epochs=1, max_grad_norm=tc.max_grad_norm)
                    times[1].append(time.perf_counter() - t0)
                    w1 = {k: p.detach().clone() for k, p in policy.named_parameters()}
                    restore()
                else:
                    restore()  # the ranks' update leaves rank 0's weights in the driver's policy
                    ranks.load(policy, trainer.optimizer, algo, trainer.store)
                    t0 = time.perf_counter()
                    res = ranks.update(traj, adv.advantages, list(out.non_tensor_batch["uid"]), plan)
                    times[2].append(time.perf_counter() - t0)
                    stats = res.stats  # the driver's policy holds rank 0's weights after it
                    w2 = {k: p.detach().clone() for k, p in policy.named_parameters()}
                devs[N] = max(devs[N], stats.ratio_max_abs_dev)
                print(f"rep {rep} N={N} update {times[N][-1]:.2f}s ratio_max_abs_dev {stats.ratio_max_abs_dev}",
                      flush=True)
            diff = max(diff, max(float((w1[k] - w2[k]).abs().max()) for k in w1))
    finally:
        if ranks is not None:
            ranks.close()
        trainer.close()
        ray.shutdown()
    med = {N: statistics.median(t) for N, t in times.items()}
    print(f"\n{args.prompts} prompts x {args.n} = {args.prompts * args.n} rows, {args.size}px, {args.steps} steps, "
          f"window 3, {args.mode}, micro-batch {args.micro_batch_size}, {args.threads} thread(s) per process, "
          f"{args.repeats} repeats, medians")
    print("| N | update (s) | time vs N=1 | max abs weight diff vs N=1 | ratio_max_abs_dev |")
    print("|---|---:|---:|---:|---:|")
    for N in (1, 2):
        print(f"| {N} | {med[N]:.2f} | {med[N] / med[1]:.2f} | {0.0 if N == 1 else diff:.3g} | {devs[N]} |")
    record_loadavg(info, "loadavg_end")
    print(json.dumps({"benchmark": "train_scaling", "update_s": {str(N): round(v, 4) for N, v in med.items()},
                      "time_ratio_n2_vs_n1": round(med[2] / med[1], 3), "max_weight_diff_n2_vs_n1": diff,
                      "ratio_max_abs_dev": {str(N): v for N, v in devs.items()}, "args": vars(args),
                      "machine": info}))


if __name__ == "__main__":
    main()
