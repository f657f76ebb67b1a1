"""The data-parallel trainer (`trainer.world_size`) on CPU: real Ray actors, a real gloo process group, the
tiny SD3 model. N = 2 against N = 1 on the same global batch, ranks on two Ray nodes, a rank killed mid-run, and the
config's refusals (docs/training/data_parallel.md)."""

import json
import os
import time

import pytest
import torch

from omniroll.config import ConfigError, load_config

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
#: the file's trainings by mode, as groups that `--dist loadgroup` could run on different workers: LoRA, full weights
#: (replicated and FSDP), the two-node cluster (`make test` runs the file whole: `--dist loadfile`, see the Makefile)
LORA, FULL, NODES = (pytest.mark.xdist_group(f"test_train_dp:{mode}") for mode in ("lora", "full", "nodes"))


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


def test_shards_are_whole_prompt_groups_and_global_steps_count_every_rank():
    from omniroll.train.parallel.shard import rows_per_update, shard_by_groups

    uids = [0, 0, 3, 3, 3, 1, 1, 2, 2]  # groups in order of first appearance: 0, 3, 1, 2
    assert shard_by_groups(uids, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert shard_by_groups(uids, 3) == [[0, 1], [2, 3, 4], [5, 6, 7, 8]]
    assert sorted(i for s in shard_by_groups(uids, 4) for i in s) == list(range(9))  # no row lost
    # micro-batches of 2, one optimizer step per 2 micro-batches: rank 0 (5 rows): 4 + 1; rank 1 (4 rows): 4
    assert rows_per_update([5, 4], 2, 2) == [8, 1]
    assert rows_per_update([5, 0], 2, 100) == [5]


def test_merged_behaviour_means_weigh_only_the_terms_that_reported_a_behaviour_ratio():
    from omniroll.train.parallel.shard import merge_stats
    from omniroll.train.update import UpdateStats

    def rank(mean, capped, scored, behaviour_scored):
        return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1, behaviour_ratio_mean=mean,
                           behaviour_weight_capped_frac=capped, scored=scored, behaviour_scored=behaviour_scored)

    # decoupled PPO: every term reports one, so the weights are the scored counts
    m = merge_stats([rank(1.2, 0.5, 10, 10), rank(1.0, 0.0, 30, 30)])
    assert (m.behaviour_ratio_mean, m.behaviour_weight_capped_frac, m.behaviour_scored) == (1.05, 0.125, 40)
    # GRPO-Guard's stale rows report it before the first update only: a rank without such terms does not dilute it
    assert merge_stats([rank(1.1, 0.0, 40, 8), rank(1.0, 0.0, 40, 0)]).behaviour_ratio_mean == 1.1
    assert merge_stats([rank(1.0, 0.0, 5, 0), rank(1.0, 0.0, 5, 0)]).behaviour_ratio_mean == 1.0  # none: plain


def step_weights(run_dir, step: int, mode: str) -> dict:
    from safetensors.torch import load_file

    ckpt = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    name = "adapter_model.safetensors" if mode == "lora" else "transformer/diffusion_pytorch_model.safetensors"
    return load_file(os.path.join(ckpt, name))


@pytest.mark.parametrize("mode,max_staleness,algorithm", [pytest.param("lora", 0, "flow_grpo", marks=LORA),
                                                          pytest.param("lora", 1, "flow_grpo", marks=LORA),
                                                          pytest.param("full", 0, "flow_grpo", marks=FULL),
                                                          pytest.param("lora", 0, "tree_grpo", marks=LORA),
                                                          pytest.param("full", 0, "tree_grpo", marks=FULL)])
def test_two_ranks_train_what_one_process_trains(ray_cluster, tiny_sd3_path, tmp_path, mode, max_staleness,
                                                 algorithm):
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


def test_bad_world_size_and_resources_are_refused_naming_the_field(tiny_sd3_path):
    import ray

    was = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"trainer\.world_size: must be in \[1, prompts_per_step=2\]"):
        dp_config(tiny_sd3_path, 3)
    with pytest.raises(ConfigError, match=r"trainer\.world_size: Input should be greater than or equal to 1"):
        dp_config(tiny_sd3_path, 0)
    with pytest.raises(ConfigError, match=r"trainer\.resources\.num_gpus: Input should be less than or equal to 1"):
        dp_config(tiny_sd3_path, 2, resources={"num_gpus": 2})
    with pytest.raises(ConfigError, match=r"trainer\.resources\.num_cpus: Input should be greater than or equal"):
        dp_config(tiny_sd3_path, 2, resources={"num_cpus": -1})
    assert ray.is_initialized() == was  # refused before Ray starts


@pytest.fixture()
def two_nodes():
    """A Ray cluster of a head and two worker nodes with one rank slot each; restores the session's local Ray."""
    import ray
    from ray.cluster_utils import Cluster

    had_local = ray.is_initialized()
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=0, resources={"rank_slot": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        yield {w.node_id for w in workers}
    finally:
        ray.shutdown()
        cluster.shutdown()
        if had_local:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)


@NODES
def test_ranks_on_two_nodes_a_killed_rank_ends_the_run_in_one_line_naming_it(two_nodes, tiny_sd3_path, tmp_path):
    """Ranks spread over two worker nodes train a step; rank 1 is killed after step 1: step 2's update (rank 0 then
    waits in the all-reduce for a dead peer) ends the run with one line naming rank 1 and its node, within seconds,
    and the driver writes the checkpoint of step 1, the last completed (no checkpoint_every: written at the failure),
    with rank 0's optimizer state."""
    import ray

    from omniroll.train import Trainer
    from omniroll.train.parallel.distributed import TrainerRankError

    cfg = dp_config(tiny_sd3_path, 2, placement="spread", resources={"num_cpus": 0, "custom": {"rank_slot": 1}},
                    checkpoint_every=0)
    out = tmp_path / "killed"
    with Trainer(cfg, str(out), log=lambda s: None) as tr:
        assert set(tr.updater.nodes) == two_nodes  # one rank on each worker node
        files = ray.get([a.__ray_call__.remote(lambda self: __import__("omniroll").__file__)
                         for a in tr.updater.actors])
        assert all(f == __import__("omniroll").__file__ for f in files)  # the ranks run this checkout's omniroll
        victim, node = tr.updater.actors[1], tr.updater.nodes[1]
        killed_at = []

        def kill_rank_1(m):
            if m["step"] == 1:
                ray.kill(victim, no_restart=True)
                killed_at.append(time.time())

        with pytest.raises(TrainerRankError) as err:
            tr.train(on_step=kill_rank_1)
        waited = time.time() - killed_at[0]
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"trainer rank 1 on node {node[:8]}") and "step 2's update" in msg, msg
    assert waited < 60, waited  # no hang: the rollout of step 2, then the failure at once
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1]
    state = torch.load(out / "checkpoints" / "step_000001" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1 and state["optimizer"]["state"]  # Adam's moments after step 1's update


def test_a_forward_process_algorithm_trains_on_two_ranks_with_its_state_kept_equal(ray_cluster, tiny_sd3_path,
                                                                                    tmp_path):
    """NFT at N = 2: its own state (the old weights, decayed after every step on every rank) stays equal on the ranks
    and the driver (which samples with it), the first step is exact, the weights move."""
    from omniroll.train import Trainer

    cfg = dp_config(tiny_sd3_path, 2, "nft", steps=2)
    with Trainer(cfg, str(tmp_path / "nft"), log=lambda s: None) as tr:
        hist = tr.train()
        ranks = tr.updater.rank_weights()
        olds = [r["old"] for r in tr.updater.algorithm_states()]
        driver_old = tr.algorithm.state_dict()["old"]
        moved = max(float(p.detach().abs().max()) for n, p in tr.policy.named_parameters() if "lora_B" in n)
    assert hist[0]["ratio_max_abs_dev"] == 0.0 and all(m["optimizer_steps"] == 1 for m in hist)
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0]) and moved > 0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(olds[0], olds[1], driver_old))


def test_uneven_shards_with_accumulation_step_together(ray_cluster, tiny_sd3_path, tmp_path):
    """3 prompt groups on 2 ranks (4 and 8 rows), an optimizer step per micro-batch of 2: rank 0 has 2 accumulation
    groups, rank 1 has 4; rank 0 joins the last 2 global steps with a zero gradient, so both step 4 times, stay
    equal, and nothing waits for a collective that never comes."""
    from omniroll.train import Trainer

    cfg = dp_config(tiny_sd3_path, 2, steps=1, prompts_per_step=3, micro_batches_per_update=1)
    with Trainer(cfg, str(tmp_path / "uneven"), log=lambda s: None) as tr:
        (m,) = tr.train()
        ranks = tr.updater.rank_weights()
    assert m["num_samples"] == 12 and m["optimizer_steps"] == 4 and m["ratio_max_abs_dev"] == 0.0
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])


@FULL
@pytest.mark.parametrize("algorithm", ["flow_grpo", "tree_grpo"])
def test_fsdp_trains_what_the_replicated_all_reduce_trains_and_resumes_bitwise(ray_cluster, tiny_sd3_path, tmp_path,
                                                                               algorithm):
    """trainer.sharding fsdp (FSDP2's fully_shard on gloo, full fine-tuning, N = 2) against the replicated all-reduce:
    prompts of different token lengths (a micro-batch scores in one or two forwards) and uneven shards (4 and 8 rows,
    an optimizer step every 2 micro-batches: rank 0 joins the second with only its zero-weight micro-batch). The same
    samples, the same first gradient (rel 1e-6), ratio_max_abs_dev 0.0, weights within RTOL_OF_MOVE; the optimizer
    state is the ranks' sharded checkpoint, and --resume from it continues bitwise (gradient checkpointing on).
    tree_grpo: the same with each prompt group a tree (whole on one rank) and one advantage per trained step."""
    from omniroll.train import Trainer

    prompts = ["a blue car", "a green bird on a branch", "a green car in the rain", "a blue bird"]
    kw = {"mode": "full", "prompts": prompts, "prompts_per_step": 3, "micro_batches_per_update": 2, "steps": 1}
    rep, _, w_rep = run(dp_config(tiny_sd3_path, 2, algorithm, **kw), str(tmp_path / "replicated"))
    fsdp_cfg = dp_config(tiny_sd3_path, 2, algorithm, **{**kw, "sharding": "fsdp", "steps": 2,
                                                         "gradient_checkpointing": True})
    sharded, _, _ = run(fsdp_cfg, str(tmp_path / "fsdp"))
    for k in ("reward_mean", "reward_std", "reward_max", "num_samples"):  # the same samples
        assert rep[0][k] == sharded[0][k], k
    assert sharded[0]["grad_norm"] == pytest.approx(rep[0]["grad_norm"], rel=1e-6, abs=0)
    assert [m["ratio_max_abs_dev"] for m in sharded] == [0.0, 0.0] and sharded[0]["optimizer_steps"] == 2
    a, b = step_weights(tmp_path / "replicated", 1, "full"), step_weights(tmp_path / "fsdp", 1, "full")
    from safetensors.torch import load_file

    init = load_file(os.path.join(tiny_sd3_path, "transformer", "diffusion_pytorch_model.safetensors"))
    moved = max(float((a[k] - init[k]).abs().max()) for k in init)
    # Adam's eps amplification (RTOL_OF_MOVE's note) may move a few elements whose gradient is near 0 differently:
    # tree_grpo, where tied nodes give many terms no advantage, had 1 of 212,864 beyond RTOL_OF_MOVE (1.2e-2 of the
    # move; 80 beyond 1e-5, with the first gradient's norm equal to 5e-7), flow_grpo none. A lost or doubly counted
    # micro-batch changes most elements' move.
    off = sum(int(((a[k] - b[k]).abs() > RTOL_OF_MOVE * moved).sum()) for k in a)
    assert moved > 0.01 and off <= 1e-4 * sum(v.numel() for v in a.values()), (off, moved)
    # the optimizer state: the ranks' torch.distributed.checkpoint directory, not a state dict through the driver
    ckpt = tmp_path / "fsdp" / "checkpoints" / "step_000001"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["optimizer"] == {"sharded": "optimizer"} and (ckpt / "optimizer" / ".metadata").is_file()
    assert not (tmp_path / "fsdp" / "rank_state").exists()  # the ranks' per-step files go with the ranks
    from omniroll.train.checkpoint import check_resumable

    with pytest.raises(ValueError, match=r"trainer\.sharding: the checkpoint .* was trained with sharding 'fsdp', this "
                                         r"run has 'replicated'"):
        check_resumable(state, dp_config(tiny_sd3_path, 2, algorithm, **kw).trainer, str(ckpt))
    with Trainer(fsdp_cfg, str(tmp_path / "resumed"), log=lambda s: None, resume=str(ckpt)) as tr:
        again = tr.train()
    assert [m["step"] for m in again] == [2] and again[0]["ratio_max_abs_dev"] == 0.0
    x, y = step_weights(tmp_path / "fsdp", 2, "full"), step_weights(tmp_path / "resumed", 2, "full")
    assert all(torch.equal(x[k], y[k]) for k in x)
