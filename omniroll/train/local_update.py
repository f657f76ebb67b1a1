"""`LocalUpdate`: the step's update in the trainer's own process (`trainer.world_size: 1`), with the calls of the
data-parallel `RankGroup` (omniroll/train/parallel/distributed.py), so the trainer calls one or the other and never
branches on which it holds (omniroll/train/parallel/updater.py chooses):

    result = updater.update(rows, advantages, uids, plan)  # an UpdateResult (omniroll/train/update.py)
    state, files = updater.optimizer_state(step)           # what the checkpoint of completed step `step` saves
    updater.close()
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from omniroll.train.algorithms import UpdatePlan
from omniroll.train.report.policy_move import policy_move, snapshot
from omniroll.train.report.stage_memory import StageMemory
from omniroll.train.update import GradientShare, UpdateResult, train_on_batch


def update_and_measure(policy, optimizer: torch.optim.Optimizer, algorithm, tc, rows, advantages: torch.Tensor,
                       plan: UpdatePlan, share: Optional[GradientShare] = None,
                       stage_done: Callable[[str], None] = lambda stage: None) -> UpdateResult:
    """The update every trainer process runs (this process, or one data-parallel rank with its `share`): the rows'
    outputs before it, the algorithm's anchors, the inner epochs, its after-update, and how far the policy moved.
    `stage_done("recompute")` / `("update")` mark the ends of those stages (peak memory). Its `peak_bytes` is None."""
    # 1. The rows' outputs before the update, to measure how far it moves the policy (report/policy_move.py).
    t0 = time.perf_counter()
    before = snapshot(policy.adapter, rows, tc.policy_move_rows, tc.micro_batch_size)
    move_s = time.perf_counter() - t0
    # 2. The algorithm's anchors (behaviour, proximal, timesteps): the recompute stage (none for a rank without rows:
    #    it only joins the all-reduces).
    t1 = time.perf_counter()
    anchors = algorithm.prepare(policy, rows, plan) if len(rows) else None
    recompute_s = time.perf_counter() - t1
    stage_done("recompute")
    # 3. The inner epochs, then the algorithm's after-update (e.g. NFT's old weights).
    stats = train_on_batch(policy, optimizer, algorithm, rows, advantages, anchors, plan,
                           num_inner_epochs=tc.num_inner_epochs, max_grad_norm=tc.max_grad_norm, share=share)
    after = algorithm.after_update(policy, plan.step)
    policy.kl_reference.after_update(policy.named_parameters(), plan.step)  # an EMA or reset reference moves
    stage_done("update")
    # 4. How far it moved.
    t2 = time.perf_counter()
    move = policy_move(before, snapshot(policy.adapter, rows, tc.policy_move_rows, tc.micro_batch_size), tc.clip_range)
    move_s += time.perf_counter() - t2
    return UpdateResult(stats=stats, prepared=anchors.metrics if anchors is not None else {}, after=after, move=move,
                        recompute_s=recompute_s, move_s=move_s)


class LocalUpdate:
    """policy, optimizer, algorithm: the trainer's own; tc: the `trainer` config section; memory: the trainer's
    `StageMemory` (this update ends its recompute and update stages)."""

    def __init__(self, policy, optimizer: torch.optim.Optimizer, algorithm, tc, memory: StageMemory):
        self.policy = policy
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.tc = tc
        self.memory = memory

    def update(self, rows, advantages: torch.Tensor, uids: list, plan: UpdatePlan) -> UpdateResult:
        """The step's update on `rows` (`uids`, its prompt groups, are the ranks' split: unused here)."""
        return update_and_measure(self.policy, self.optimizer, self.algorithm, self.tc, rows, advantages, plan,
                                  stage_done=self.memory.end)  # peak_bytes None: `memory` measured this process

    def optimizer_state(self, step: int) -> tuple[dict, Optional[dict]]:
        """For the checkpoint of completed step `step`: (the optimizer's state dict, no files beside it)."""
        return self.optimizer.state_dict(), None

    def close(self) -> None:
        """Nothing to end: the update ran in this process."""
