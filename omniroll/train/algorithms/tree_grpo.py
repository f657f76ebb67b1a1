"""Tree-GRPO: Flow-GRPO's clipped objective on a tree rollout (`algo.tree`), each recorded step of a leaf credited with
the advantage of the tree node whose noise it drew (TempFlow-GRPO's per-step credit, arXiv 2508.04324; BranchGRPO's
depth-wise normalisation and step pruning, arXiv 2509.06040).

Rollout: a prompt group is a tree that forks at `algo.tree.fork_steps` into `widths` children per level; each leaf
is an ordinary sample with exact log-probs, and its `tree_path` names the child it took at each fork
(omniroll/engine/tree.py). Advantages (omniroll/train/tree_advantages.py), per leaf and recorded step: at a step in
[fork_steps[d], fork_steps[d + 1]) the leaf's noise is that of its node at depth d + 1, so the step's advantage is
that node's: V(child) - V(parent), V a node's mean leaf reward, divided by the std of those differences over the
batch's nodes of that depth, clipped to +-adv_clip_max. A leaf's last segment is its own (V(leaf) is its reward).

Not trained: the window steps before the first fork. Every leaf of a tree draws the same noise there from the same
latent, so their log-probs are one number per tree and any per-leaf advantage is meaningless; the root's advantage
(its mean against itself) is 0, and a zero-advantage clipped term has zero policy gradient, so training them would
only spend forwards (and, with kl_beta > 0, add the KL of a step the tree does not credit).

`trainer.algorithm_options.trained_steps`: `all` (every recorded step from the first fork on) or `forks` (only the
fork steps, one loss term per depth: the step whose noise first separates the siblings; BranchGRPO-style pruning,
fewer forwards per update). Loss per trained step: Flow-GRPO's (`ppo_clip_loss`, or the decoupled PPO with
`max_staleness` >= 1) with that step's advantage; with the rollout's weights every ratio is exactly 1.0 before the
first optimizer update (`ratio_max_abs_dev == 0.0`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from omniroll.train.advantages import Advantages
from omniroll.train.algorithms.base import UpdatePlan
from omniroll.train.algorithms.flow_grpo import FlowGRPO
from omniroll.train.algorithms.terms import LossInput, LossTerms
from omniroll.train.trajectory_batch import TrajectoryBatch
from omniroll.train.tree_advantages import node_advantages, tree_step_advantages


def tree_trained_steps(step_indices: torch.Tensor, fork_steps, trained_steps: str) -> torch.Tensor:
    """[B, terms] long: the window positions each row trains (`step_indices` [B, W]: each window step's denoising
    step), in order: every step at or after the first fork (`all`) or the fork steps only (`forks`). ValueError when
    rows would train different numbers of steps (their SDE windows differ) or a row trains none."""
    si = step_indices.long().cpu()
    forks = torch.tensor(list(fork_steps), dtype=torch.long)
    keep = si >= forks[0] if trained_steps == "all" else (si.unsqueeze(-1) == forks).any(-1)
    counts = keep.sum(1)
    if len(si) and (int(counts.min()) != int(counts.max()) or int(counts.min()) == 0):
        raise ValueError(f"trained_steps {trained_steps}: the rows' SDE windows give them "
                         f"{sorted(set(counts.tolist()))} trained steps at or after fork steps {list(fork_steps)}; "
                         f"every row must train the same number (>= 1): one SDE window for every sample, or "
                         f"trained_steps forks")
    T = int(counts[0]) if len(si) else 0
    pos = torch.arange(si.shape[1]).expand_as(si)
    return pos[keep].reshape(len(si), T)


class TreeGRPO(FlowGRPO):
    name = "tree_grpo"

    def advantages(self, rewards: torch.Tensor, groups, batch=None) -> Advantages:
        """[B, W] advantages, one per recorded step (module doc), from the rollout batch's `tree_path` and
        `step_indices` columns; metrics: each depth's mean |advantage| and the leaves whose tree the agent loop ran
        again whole (`tree/rerun_leaves`, from its `tree_rerun` column)."""
        if batch is None or "tree_path" not in batch.non_tensor_batch or "step_indices" not in batch.batch.keys():
            raise ValueError("trainer.algorithm tree_grpo: the advantages need the rollout batch's tree_path and "
                             "step_indices columns (a rollout with algo.tree and log-probs)")
        paths = [tuple(int(c) for c in p) for p in batch.non_tensor_batch["tree_path"]]
        node = node_advantages(rewards, list(groups), paths, self.tc.adv_clip_max)
        steps = tree_step_advantages(node, self.config.algo.tree.fork_steps, batch.batch["step_indices"])
        r = rewards.detach().double().reshape(-1)
        rows: dict = {}
        for i, g in enumerate(groups):
            rows.setdefault(g, []).append(i)
        tied = [float(r[ix[0]]) for ix in rows.values() if bool((r[ix] == r[ix[0]]).all())]
        metrics = {f"tree/depth_{d}_adv_abs_mean": float(node[:, d].abs().mean()) for d in range(node.shape[1])}
        if "tree_rerun" in batch.non_tensor_batch:  # leaves whose tree ran again whole: it straddled a weight update
            metrics["tree/rerun_leaves"] = sum(bool(x) for x in batch.non_tensor_batch["tree_rerun"])
        return Advantages(steps, len(tied), len(rows), tied, metrics)

    def train_steps(self, rows: TrajectoryBatch, plan: UpdatePlan) -> torch.Tensor:
        """[B, terms]: the window steps each row trains: from the first fork on, or the fork steps only."""
        if rows.step_indices is None:
            raise ValueError("trainer.algorithm tree_grpo: the rows carry no step_indices (the denoising step of "
                             "each window step)")
        return tree_trained_steps(rows.step_indices, self.config.algo.tree.fork_steps,
                                  self.options.trained_steps)

    def loss(self, inp: LossInput) -> LossTerms:
        """Flow-GRPO's loss of the term's window step, with that step's advantage (inp.adv: [b, W])."""
        steps = inp.anchors.steps_of[inp.idx, inp.term]
        step_adv = inp.adv[torch.arange(len(inp.idx), device=inp.adv.device), steps.to(inp.adv.device)]
        return super().loss(replace(inp, adv=step_adv))
