"""The data-parallel trainer (`trainer.world_size`) on CPU with LoRA: real Ray actors, a real gloo process group,
the tiny SD3 model. N = 2 against N = 1 on the same global batch (Flow-GRPO, asynchronous, Tree-GRPO), NFT's state on
two ranks, uneven shards, and the config's refusals (docs/training/data_parallel.md). Full weights, FSDP and ranks on
two nodes: tests/test_train_dp_full.py."""

import pytest
import torch

from dp_helpers import check_two_ranks_train_what_one_process_trains, dp_config
from omniroll.config import ConfigError


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


@pytest.mark.parametrize("max_staleness,algorithm", [(0, "flow_grpo"), (1, "flow_grpo"), (0, "tree_grpo")])
def test_two_ranks_train_what_one_process_trains(ray_cluster, tiny_sd3_path, tmp_path, max_staleness, algorithm):
    """LoRA (dp_helpers.check_two_ranks_train_what_one_process_trains); Flow-GRPO synchronous also resumes bitwise."""
    check_two_ranks_train_what_one_process_trains(tiny_sd3_path, tmp_path, "lora", max_staleness, algorithm)


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
