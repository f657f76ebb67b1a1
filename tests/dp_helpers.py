"""What the data-parallel trainer's tests share (tests/test_train_dp.py: LoRA, NFT, uneven shards, the config;
tests/test_train_dp_full.py: full weights, FSDP, ranks on two nodes): the tiny SD3 run's config, a run, its weights
at a step, and the N = 2 against N = 1 check both files run. Two files, so that `make test`'s workers share them."""

import json
import os
import time

import pytest
import torch

from omniroll.config import load_config

PROMPTS = ["a blue car", "a green bird", "a green car", "a blue bird"]
#: N = 2 against N = 1 on the same batch: the all-reduce adds two ranks' partial gradients where one process adds the
#: micro-batches in another order (and each rank shuffles its own shard), so a gradient element differs in its last
#: bits. Adam's first steps move a weight by lr g / (|g| + eps): near g = 0 that multiplies a gradient difference by
#: up to lr / eps = 1e6, so an element whose partial gradients cancel moves a little differently. The tolerance is
#: relative to the largest move, 1e-2 of it (measured after 3 updates: 4e-5 of it for LoRA, 6e-4 for full weights);
#: a lost or doubly counted micro-batch (a quarter of the rows here) changes the update by tens of percent of the
#: move, and ranks that did not share their gradients would differ from each other (asserted bitwise). The gradient's
#: scale, which Adam hides in the weights, is compared through the first step's grad_norm (rel 1e-6).
RTOL_OF_MOVE = 1e-2

#: tree_grpo's rollout: one fixed window (steps 0-2 of 4), forks at steps 1 and 2 into 2 children each: n = 4 leaves
TREE_ALGO = {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 3, "sde_window_range": [0, 3],
             "tree": {"fork_steps": [1, 2], "widths": [2, 2]}}


def dp_config(model, world_size=1, algorithm="flow_grpo", **trainer):
    algo = {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]}
    algo = {"nft": {}, "tree_grpo": TREE_ALGO}.get(algorithm, algo)
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5,
                     "max_sequence_length": 8},
        "algo": algo, "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"}}},
        "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"algorithm": algorithm, "prompts": PROMPTS, "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 2, "steps": 3, "num_threads": 1, "checkpoint_every": 1,
                    "world_size": world_size, "resources": {"num_cpus": 0}, **trainer},
    })


def run(cfg, out, **kw):
    from omniroll.train import Trainer

    with Trainer(cfg, out, log=lambda s: None) as tr:
        hist = tr.train(**kw)
        ranks = tr.updater.rank_weights() if tr.tc.world_size > 1 else []  # the RankGroup's
        final = {k: p.detach().clone() for k, p in tr.policy.named_parameters()}
    return hist, ranks, final


def step_weights(run_dir, step: int, mode: str) -> dict:
    from safetensors.torch import load_file

    ckpt = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    name = "adapter_model.safetensors" if mode == "lora" else "transformer/diffusion_pytorch_model.safetensors"
    return load_file(os.path.join(ckpt, name))


def check_two_ranks_train_what_one_process_trains(tiny_sd3_path, tmp_path, mode, max_staleness, algorithm):
    """Step 1 runs 3 optimizer updates (3 inner epochs) on one batch, the same at N = 1 and N = 2: its weights agree
    to RTOL_OF_MOVE. Steps 2 and 3 roll out with those weights (1e-6 apart), so their samples differ in the last bits
    too and Adam's per-element normalisation amplifies that where a gradient is near its eps: no tolerance is asserted
    there (the measured drift is in the docs); exactness, equal ranks and one record per step are. tree_grpo: each
    prompt group is a tree (2 x 2 leaves), whole on one rank, its step-level advantages computed on the whole batch."""
    from safetensors.torch import load_file

    kw = {"mode": mode, "max_staleness": max_staleness, "num_inner_epochs": 3}
    one, _, _ = run(dp_config(tiny_sd3_path, 1, algorithm, **kw), str(tmp_path / "n1"), steps=1)  # step 1 compared
    t0 = time.time()
    two, ranks, w2 = run(dp_config(tiny_sd3_path, 2, algorithm, **kw), str(tmp_path / "n2"))
    print(f"N=2, {algorithm}, {mode}, max_staleness {max_staleness}: {time.time() - t0:.1f}s")
    # the same samples and advantages at step 1 (same weights, same seeds: the rollout does not depend on N), and the
    # same first gradient (its norm: a wrong loss normalisation, which Adam would hide in the weights, shows here)
    for k in ("reward_mean", "reward_std", "reward_max", "tied_groups", "num_samples"):
        assert one[0][k] == two[0][k], k
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-6, abs=0)
    if algorithm == "tree_grpo":  # the step-level advantages are the whole batch's (each depth's nodes, every tree)
        depths = sorted(k for k in one[0] if k.startswith("tree/depth_"))
        assert len(depths) == 2 and [two[0][k] for k in depths] == [one[0][k] for k in depths] and one[0][depths[1]]
    # the ratio statistics per timestep are the whole batch's: every rank's terms summed (omniroll/train/ratio_steps.py)
    per_step = sorted(k for k in one[0] if k.startswith("ratio_samples_ts_"))
    assert per_step and [two[0][k] for k in per_step] == [one[0][k] for k in per_step]
    # and their values agree as the weights do (the ranks' summation order; measured: std within 3e-5 relative, means
    # within 5e-5 of the step's std): a mean of the ranks' stds, or one rank's, would not
    for k in per_step:
        t = k.removeprefix("ratio_samples_ts_")
        std = one[0][f"ratio_std_ts_{t}"]
        assert std > 0 and two[0][f"ratio_std_ts_{t}"] == pytest.approx(std, rel=1e-3)
        assert abs(two[0][f"ratio_mean_ts_{t}"] - one[0][f"ratio_mean_ts_{t}"]) <= 1e-3 * std
    # exact at every rank, every step; 3 updates a step on every rank
    assert [m["ratio_max_abs_dev"] for m in two] == [0.0] * 3
    assert [m["optimizer_steps"] for m in two] == [3] * 3
    # the ranks hold the same weights (they stepped with one all-reduced gradient), and the driver holds rank 0's
    assert all(torch.equal(ranks[0][k], ranks[1][k]) and torch.equal(ranks[0][k], w2[k]) for k in w2)
    # after step 1's 3 updates N = 2 holds what N = 1 holds, up to the all-reduce's summation order
    a, b = (step_weights(tmp_path / n, 1, mode) for n in ("n1", "n2"))
    if mode == "lora":  # lora_B starts at 0
        init = {k: torch.zeros_like(v) for k, v in a.items() if "lora_B" in k}
    else:
        init = load_file(os.path.join(tiny_sd3_path, "transformer", "diffusion_pytorch_model.safetensors"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    moved = max(float((a[k] - init[k]).abs().max()) for k in init)
    print(f"step 1: max |w(N=1) - w(N=2)| {diff:.3g} (moved up to {moved:.3g})")
    assert moved > 0.01 and diff <= RTOL_OF_MOVE * moved
    # one metrics.jsonl line and one checkpoint per step
    lines = [json.loads(x) for x in open(tmp_path / "n2" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path / "n2" / "checkpoints")) == ["latest", "step_000001", "step_000002",
                                                                   "step_000003"]
    if mode == "lora" and max_staleness == 0 and algorithm == "flow_grpo":  # --resume at the same N: bitwise
        from omniroll.train import Trainer

        resumed = str(tmp_path / "resumed")
        with Trainer(dp_config(tiny_sd3_path, 2, algorithm, **kw), resumed, log=lambda s: None,
                             resume=str(tmp_path / "n2" / "checkpoints" / "step_000002")) as tr:
            again = tr.train()
        assert [m["step"] for m in again] == [3] and again[0]["ratio_max_abs_dev"] == 0.0
        x, y = step_weights(tmp_path / "n2", 3, mode), step_weights(resumed, 3, mode)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        s_x, s_y = (torch.load(os.path.join(d, "checkpoints", "step_000003", "trainer_state.pt"), weights_only=True)
                    for d in (tmp_path / "n2", resumed))
        assert all(torch.equal(s_x["optimizer"]["state"][i][k], s_y["optimizer"]["state"][i][k])
                   for i in s_x["optimizer"]["state"] for k in ("exp_avg", "exp_avg_sq"))
