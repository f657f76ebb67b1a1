"""Every `trainer.algorithm` end to end on the tiny model and a local Ray cluster: 3 steps with a finite
loss that move the weights, each algorithm's exactness, its rollout contract, and a resume that is bitwise the
straight run (weights, optimizer, the algorithm's own state)."""

import asyncio
import math
import os

import pytest
import torch

from omniroll.config import load_config
from omniroll.config.algorithms import ALGORITHMS, algorithms_with

PROMPTS = ["a blue car", "a green bird"]
SDE = {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]}


def algo_section(algorithm: str) -> dict:
    """The `algo` section a registered algorithm's test run samples with, from what its spec needs: none for a
    forward-process one; else its first SDE type (dance_sde at eta 0.5 on every step but the last; the others on a
    2-step window), the shared initial noise and a tree (forking at steps 1 and 2, on a 3-step window) where it needs
    them."""
    spec = ALGORITHMS[algorithm]
    if spec.rollout == "clean_latent":
        return {}
    sde_type = spec.sde_types[0]
    out = {"noise_level": 0.5, "sde_type": sde_type} if sde_type == "dance_sde" else {**SDE, "sde_type": sde_type}
    if spec.same_latent:
        out["same_latent"] = True
    if spec.tree:
        out.update(sde_window_size=3, tree={"fork_steps": [1, 2], "widths": [2, 2]})
    return out


def clean_latent(algorithm: str) -> bool:
    return ALGORITHMS[algorithm].rollout == "clean_latent"


def config(model, algorithm, merge_lora=False, **trainer):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1, "merge_lora": merge_lora},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5,
                     "max_sequence_length": 8},
        "algo": algo_section(algorithm), "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"}}},
        "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"algorithm": algorithm, "prompts": PROMPTS, "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 4, "steps": 3, "num_threads": 1, "checkpoint_every": 1, **trainer},
    })


def weights(ckpt):
    from safetensors.torch import load_file

    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


def state(ckpt):
    return torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=True)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_each_algorithm_trains_exactly_and_resumes_bitwise(ray_cluster, tiny_sd3_path, tmp_path, algorithm):
    from omniroll.train import Trainer

    cfg = config(tiny_sd3_path, algorithm, merge_lora=algorithm == "awm")  # AWM rolls out merged, as in the demo
    straight = str(tmp_path / "straight")
    with Trainer(cfg, straight, log=lambda s: None) as tr:
        hist = tr.train()
        batch = asyncio.run(tr._rollout(4))  # what its rollout returns (the replicas hold step 3's sampling weights)
        check_rollout_contract(tr, algorithm, batch)
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["optimizer_steps"] == 1 for m in hist)
    w0 = weights(os.path.join(straight, "checkpoints", "step_000001"))
    w3 = weights(os.path.join(straight, "checkpoints", "step_000003"))
    assert any(not torch.equal(w0[k], w3[k]) for k in w0)  # the weights moved
    devs = [m["ratio_max_abs_dev"] for m in hist]
    if algorithm == "nft":  # max |v_theta - v_old| before the first update: 0 while old == theta (the first step)
        assert devs[0] == 0.0 and all(0 < d < 1 for d in devs[1:]) and [m["old_decay"] for m in hist] == \
            [0.001, 0.002, 0.003]
    else:  # the ratio of the trained weights to the sampling ones is exactly 1 before the first update
        assert devs == [0.0] * 3
    per_step = [k for m in hist for k in m if "_ts_" in k]  # the per-timestep ratio statistics (test_ratio_steps.py)
    if clean_latent(algorithm):  # no importance ratio, no ratio statistics
        assert not per_step and not any("ratio_mean" in m for m in hist)
    else:  # one optimizer update per step scores every term before it: every ratio is exactly 1, at every timestep
        assert per_step and all(m[k] == 1.0 for m in hist for k in m if k.startswith("ratio_mean"))
        assert all(m[k] == 0.0 for m in hist for k in m
                   if k.startswith(("ratio_std", "clip_frac_higher", "clip_frac_lower", "log_prob_abs_diff")))

    # resume from step 2: bitwise the straight run's step 3
    resumed = str(tmp_path / "resumed")
    import shutil

    shutil.copytree(straight, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step_000003"))
    with open(os.path.join(resumed, "checkpoints", "latest"), "w") as f:
        f.write("step_000002\n")
    with Trainer(cfg, resumed, resume=resumed, log=lambda s: None) as tr:
        tr.train()
    a, b = (os.path.join(d, "checkpoints", "step_000003") for d in (straight, resumed))
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = state(a), state(b)
    assert all(torch.equal(sa["optimizer"]["state"][i]["exp_avg"], sb["optimizer"]["state"][i]["exp_avg"])
               for i in sa["optimizer"]["state"])
    old_a, old_b = (s["algorithm_state"].get("old") for s in (sa, sb))
    assert (old_a is None) == (algorithm != "nft") and (old_a is None or all(map(torch.equal, old_a, old_b)))


def test_grpo_guard_with_stale_rows_logs_the_exactness_check_and_the_move_under_its_own_name(ray_cluster, tiny_sd3_path,
                                                                                             tmp_path):
    """GRPO-Guard anchors its ratio at the behaviour, so with stale rows its ratio also carries the policy's move since;
    ratio_max_abs_dev stays what it is for every algorithm: the behaviour's recompute against the recorded log-prob;
    the move is logged as behaviour_ratio_max_abs_dev (decoupled PPO's name for pi_prox / pi_behaviour)."""
    from omniroll.train import FlowGRPOTrainer

    cfg = config(tiny_sd3_path, "grpo_guard", max_staleness=1, checkpoint_every=0)
    with FlowGRPOTrainer(cfg, str(tmp_path / "run"), log=lambda s: None) as tr:
        hist = tr.train()
    assert max(m["staleness_max"] for m in hist) >= 1  # the rows of a later step were sampled by older weights
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0] * 3
    moved = [m["behaviour_ratio_max_abs_dev"] for m in hist if m["staleness_max"] >= 1]
    assert moved and all(x > 0 for x in moved)  # older weights sampled those rows: the policy moved since
    assert all(m["behaviour_ratio_max_abs_dev"] == 0.0 for m in hist if m["staleness_max"] == 0)


RATIO_NAMES = ("ratio_mean", "ratio_std", "clip_frac_higher", "clip_frac_lower", "log_prob_abs_diff", "ratio_samples")


@pytest.mark.parametrize("algorithm", ["flow_grpo", "grpo_guard", "dance_grpo"])
def test_the_ratio_statistics_per_timestep_add_up_to_the_steps_own(ray_cluster, tiny_sd3_path, tmp_path, algorithm):
    """Two optimizer updates per step (`micro_batches_per_update: 1` over two micro-batches): the second micro-batch's
    ratios depart from 1. metrics.jsonl has every statistic per denoising step index (`..._ts_<t>`, the trajectory's
    step, not the window's: the windows start at step 0 or 1), and the per-step numbers weighted by their samples give
    the step's overall ratio mean, its variance (within plus between the timesteps), its clip_frac (above plus below)
    and its mean |log-prob difference|."""
    from omniroll.train import Trainer
    from omniroll.train.report.tracking import step_records

    out = str(tmp_path / "run")
    with Trainer(config(tiny_sd3_path, algorithm, steps=2, micro_batches_per_update=1, checkpoint_every=0), out,
                 log=lambda s: None) as tr:
        tr.train()
    records = step_records(out)
    trained = {"dance_grpo": 1}.get(algorithm, 2)  # trained window steps per row
    seen = set()
    for m in records:
        assert m["ratio_max_abs_dev"] == 0.0 and m["optimizer_steps"] == 2
        ts = sorted(int(k.split("_ts_")[1]) for k in m if k.startswith("ratio_mean_ts_"))
        assert ts and all(f"{name}_ts_{t}" in m for name in RATIO_NAMES for t in ts)
        seen |= set(ts)
        n = {t: m[f"ratio_samples_ts_{t}"] for t in ts}
        N = sum(n.values())
        assert N == m["ratio_samples"] == 8 * trained  # every (row, trained step) once: one inner epoch

        def over_steps(name):
            return sum(n[t] * m[f"{name}_ts_{t}"] for t in ts) / N

        assert over_steps("ratio_mean") == pytest.approx(m["ratio_mean"], rel=1e-12)
        assert over_steps("log_prob_abs_diff") == pytest.approx(m["log_prob_abs_diff"], rel=1e-9)
        assert over_steps("clip_frac_higher") + over_steps("clip_frac_lower") == pytest.approx(m["clip_frac"],
                                                                                              abs=1e-12)
        between = sum(n[t] * (m[f"ratio_mean_ts_{t}"] - m["ratio_mean"]) ** 2 for t in ts) / N
        within = sum(n[t] * m[f"ratio_std_ts_{t}"] ** 2 for t in ts) / N
        assert within + between == pytest.approx(m["ratio_std"] ** 2, rel=1e-6)
        assert m["ratio_std"] > 0  # the second micro-batch's ratios moved ...
        assert all(m[f"log_prob_abs_diff_ts_{t}"] > 0 for t in ts if m[f"ratio_std_ts_{t}"] > 0)  # ... and so its logp
    assert seen <= {0, 1, 2} and (algorithm == "dance_grpo" or seen == {0, 1, 2})


def check_rollout_contract(tr, algorithm, batch):
    keys = set(batch.batch.keys())
    if clean_latent(algorithm):
        # no log-probs, no trajectory: the clean final latent beside the pixels, CFG off, the ODE
        assert "rollout_log_probs" not in keys and batch.batch["all_latents"].shape[1] == 0
        assert "latents" in keys and bool((batch.batch["cfg_scale"] == 0).all())
        assert set(batch.non_tensor_batch["sde_type"]) == {"ode"}
        assert {e["merge_lora"] for e in batch.non_tensor_batch["execution"]} == {algorithm == "awm"}
        if algorithm == "nft":
            replay_matches_rollout(tr, batch)
        return
    assert batch.batch["rollout_log_probs"].shape[1] >= 1
    if algorithm == "tree_grpo":  # each group a tree: leaves share the latents up to the fork their paths part at
        lat, uids = batch.batch["all_latents"], list(batch.non_tensor_batch["uid"])
        paths = [tuple(p) for p in batch.non_tensor_batch["tree_path"]]
        assert batch.batch["step_indices"].tolist() == [[0, 1, 2]] * len(uids)
        for i in range(len(uids)):
            for j in range(len(uids)):
                if uids[i] == uids[j] and i != j:
                    shared = 2 + (paths[i][0] == paths[j][0])  # states before steps 0, 1 (and 2 for siblings)
                    assert torch.equal(lat[i, :shared], lat[j, :shared]) and not torch.equal(lat[i], lat[j])
    if algorithm == "dance_grpo":  # a group shares its initial noise (the window starts at step 0), groups differ
        first = batch.batch["all_latents"][:, 0]
        uids = list(batch.non_tensor_batch["uid"])
        for u in set(uids):
            rows = [i for i, x in enumerate(uids) if x == u]
            assert all(torch.equal(first[rows[0]], first[i]) for i in rows)
        assert len({tuple(first[i].flatten()[:4].tolist()) for i in range(len(uids))}) == len(set(uids))


def replay_matches_rollout(tr, batch):
    """NFT's x0 is the Euler ODE's final latent under the `old` weights (the replicas sample with them): replayed in
    the trainer from the row's seed with `old` swapped in, every step through the loss's own velocity call, it is the
    rollout's x0 bitwise."""
    from omniroll.sampling import make_generator, sde_step
    from omniroll.train import CleanBatch

    rows = CleanBatch.from_batch(batch, tr.policy.adapter)
    seeds = [int(s) for s in batch.non_tensor_batch["seed"]]
    x = torch.stack([torch.randn(rows.x0.shape[1:], generator=make_generator(s)) for s in seeds])
    with torch.no_grad(), tr.algorithm.sampling_weights(tr.policy):
        for k in range(rows.num_steps):
            v = rows.velocity(tr.policy.adapter, x, rows.sigmas[:, k])
            x = sde_step(x, v, rows.sigmas[:, k], rows.sigmas[:, k + 1], 0.0, "ode").prev_sample
        assert torch.equal(x, rows.x0)
    x_theta = x  # and with the trained weights it is not (old != theta after three steps)
    assert not torch.equal(rows.velocity(tr.policy.adapter, x_theta, rows.sigmas[:, 0]),
                           _old_velocity(tr, rows, x_theta))


def _old_velocity(tr, rows, x):
    with torch.no_grad(), tr.algorithm.sampling_weights(tr.policy):
        return rows.velocity(tr.policy.adapter, x, rows.sigmas[:, 0])


@pytest.mark.parametrize("algorithm", algorithms_with("clean_latent"))
def test_timesteps_per_forward_stacks_a_terms_timesteps_into_one_forward_with_the_same_update(
        ray_cluster, tiny_sd3_path, tmp_path, algorithm):
    """`algorithm_options.timesteps_per_forward: 2` on a step of 3 training timesteps: terms of 2 and 1 timesteps (the
    shorter one weighted so that each timestep weighs the same), every timestep's noise drawn as at 1, so the rows a
    forward sees are those of one forward per timestep bitwise (the engine's batch-invariant kernels) and the update
    differs only in its summation order: the same loss, gradient norm and (pair) count, weights within RTOL_OF_MOVE of
    their move (Adam's first step near g = 0, as in tests/test_train_dp.py)."""
    from test_grad_signal import fresh

    from omniroll.train import CleanBatch, Trainer
    from omniroll.train.algorithms import UpdatePlan
    from omniroll.train.algorithms.terms import LossInput
    from omniroll.train.micro_batches import group_index
    from omniroll.train.update import train_on_batch

    with Trainer(config(tiny_sd3_path, algorithm, steps=1), str(tmp_path / "run"), log=lambda s: None) as tr:
        batch = asyncio.run(tr._rollout(1))
    uids = list(batch.non_tensor_batch["uid"])
    rewards = batch.batch["rm_scores"][:, 0].float()
    results = {}
    for k in (1, 2):
        cfg = config(tiny_sd3_path, algorithm, algorithm_options={"timesteps_per_forward": k})
        policy, algo, _ = fresh(cfg, tiny_sd3_path)  # a non-zero LoRA B, so every LoRA weight has a gradient
        start = {n: p.detach().clone() for n, p in policy.named_parameters()}
        rows = CleanBatch.from_batch(batch, policy.adapter)
        adv = algo.advantages(rewards, uids).advantages
        plan = UpdatePlan(step=1, seed=0, micro_batch_size=4, groups=group_index(uids))  # online_dpo pairs by group
        anchors = algo.prepare(policy, rows, plan)
        assert anchors.t_of.shape[1] == 3 and algo.num_terms(rows, anchors) == {1: 3, 2: 2}[k]
        idx = torch.arange(4)
        terms = [algo.noised(LossInput(policy, rows.rows(idx), idx, adv[idx], j, anchors, plan)) for j in range(2)]
        assert [len(x.rows) for x in terms] == {1: [4, 4], 2: [8, 4]}[k]
        assert [x.weight for x in terms] == {1: [1.0, 1.0], 2: [4 / 3, 2 / 3]}[k]
        stats = train_on_batch(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), algo, rows, adv, anchors,
                               plan, num_inner_epochs=1, max_grad_norm=1e9)
        results[k] = (stats, {n: p.detach().clone() for n, p in policy.named_parameters()}, start)
    (one, w1, start), (two, w2, _) = results[1], results[2]
    assert one.scored == two.scored == 3 * len(uids) and one.ratio_max_abs_dev == two.ratio_max_abs_dev == 0.0
    assert two.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-6)  # AWM's on-policy loss is 0 in value
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    moved = max(float((w1[n] - start[n]).abs().max()) for n in w1)
    diff = max(float((w1[n] - w2[n]).abs().max()) for n in w1)
    assert moved > 1e-4 and diff <= 1e-2 * moved
