"""The data-parallel trainer (`trainer.world_size`) on CPU with full weights: N = 2 against N = 1, FSDP2 against
the replicated all-reduce (and --resume from its sharded checkpoint), and ranks on two Ray nodes with a rank killed
mid-run. LoRA and the config: tests/test_train_dp.py."""

import json
import os
import time

import pytest
import torch

from dp_helpers import RTOL_OF_MOVE, check_two_ranks_train_what_one_process_trains, dp_config, run, step_weights


@pytest.mark.parametrize("algorithm", ["flow_grpo", "tree_grpo"])
def test_two_ranks_train_what_one_process_trains_full_weights(ray_cluster, tiny_sd3_path, tmp_path, algorithm):
    """Full fine-tuning (dp_helpers.check_two_ranks_train_what_one_process_trains)."""
    check_two_ranks_train_what_one_process_trains(tiny_sd3_path, tmp_path, "full", 0, algorithm)


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
