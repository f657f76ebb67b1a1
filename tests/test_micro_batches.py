"""The algorithm's micro-batch hook (`Algorithm.micro_batches`, omniroll/train/micro_batches.py): the default cut is
the rows one by one; `whole_group_micro_batches` keeps every prompt group in one micro-batch, through the update loop
itself; an algorithm with its own cut is refused, by name, where the data-parallel driver would plan another."""

import pytest
import torch

from omniroll.config import load_config
from omniroll.train.algorithms import REGISTRY, FlowGRPO, UpdatePlan, make_algorithm
from omniroll.train.algorithms.base import shuffle_generator
from omniroll.train.micro_batches import group_index, whole_group_micro_batches
from omniroll.train.update import train_on_batch
from tests.test_grad_signal import fresh, step_batch  # noqa: F401 - step_batch is a fixture


@pytest.mark.parametrize("per_update", [None, 1, 2])
def test_whole_group_micro_batches_keep_groups_whole_and_halves_apart(per_update):
    uids = [u for u, n in zip("abcdefg", (3, 3, 2, 5, 3, 1, 3)) for _ in range(n)]
    groups = group_index(uids)
    assert groups.tolist()[:7] == [0, 0, 0, 1, 1, 1, 2]
    halves = torch.tensor([u in "bdf" for u in uids])
    for h in (None, halves):
        ep = whole_group_micro_batches(groups, h, 4, per_update, torch.Generator().manual_seed(3))
        assert sorted(torch.cat(ep.chunks).tolist()) == list(range(len(uids)))  # every row once
        for chunk in ep.chunks:  # whole groups only; at most 4 rows unless one group is larger (d: 5 rows)
            members = set(groups[chunk].tolist())
            assert all(int((groups == g).sum()) == sum(int(groups[i] == g) for i in chunk) for g in members)
            assert len(chunk) <= 4 or len(members) == 1
        if h is not None:
            assert all({bool(h[i]) for i in c.tolist()} == {a} for c, a in zip(ep.chunks, ep.half_a))
        again = whole_group_micro_batches(groups, h, 4, per_update, torch.Generator().manual_seed(3))
        assert [c.tolist() for c in again.chunks] == [c.tolist() for c in ep.chunks]  # a function of the generator


class WholeGroups(FlowGRPO):
    """A group objective's cut (what online DPO or DGPO would declare), recording the rows each loss term saw
    (Flow-GRPO's loss and registration otherwise)."""

    def __init__(self, config, adapter):
        super().__init__(config, adapter)
        self.seen = []

    def micro_batches(self, rows, plan, epoch):
        return whole_group_micro_batches(plan.groups, plan.halves, plan.micro_batch_size, plan.per_update,
                                         shuffle_generator(plan.seed, plan.step, epoch))  # a resume shuffles the same

    def loss(self, inp):
        self.seen.append(inp.idx.tolist())
        return super().loss(inp)


def test_the_update_loop_trains_on_the_algorithms_own_micro_batches(step_batch, tiny_sd3_path):  # noqa: F811
    cfg, traj, uids, rewards = step_batch
    policy, _, store = fresh(cfg, tiny_sd3_path)
    algorithm = WholeGroups(cfg, policy.adapter)
    groups = group_index(uids)
    plan = UpdatePlan(step=1, seed=0, micro_batch_size=4, per_update=1, store=store, groups=groups,
                      versions=torch.ones(len(traj), traj.num_steps, dtype=torch.long))
    anchors = algorithm.prepare(policy, traj, plan)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    stats = train_on_batch(policy, opt, algorithm, traj, algorithm.advantages(rewards, uids).advantages, anchors,
                           plan, num_inner_epochs=1, max_grad_norm=1.0)
    # 5 groups of 3 rows, at most 4 rows a micro-batch: one group per micro-batch, one optimizer step each
    assert stats.optimizer_steps == 5 and stats.ratio_max_abs_dev == 0.0
    cut = {tuple(sorted(s)) for s in algorithm.seen}
    assert sorted(cut) == sorted(tuple(i for i, u in enumerate(uids) if u == p) for p in dict.fromkeys(uids))


def test_an_algorithm_with_its_own_cut_is_refused_on_several_ranks(tiny_sd3_path, monkeypatch):
    cfg = load_config({"engine": {"model": tiny_sd3_path}, "reward": {"functions": {"r": {"fn": "prompt_colour"}}},
                       "n": 2, "trainer": {"prompts": ["a", "b"], "prompts_per_step": 2, "world_size": 2,
                                           "algorithm": "flow_grpo"}})
    monkeypatch.setitem(REGISTRY, "flow_grpo", WholeGroups)  # as if a registered algorithm declared its own cut
    with pytest.raises(ValueError, match=r"trainer.world_size: flow_grpo cuts its own micro-batches .* got 2"):
        make_algorithm(cfg, None)
