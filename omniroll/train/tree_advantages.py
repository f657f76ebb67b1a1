"""Step-level advantages of a tree rollout (TempFlow-GRPO's per-step credit, BranchGRPO's depth-wise normalisation):
each fork's children are credited with the mean leaf reward under the child against the node's (`node_advantages`),
and each recorded step of a leaf takes the advantage of the node whose noise it drew (`tree_step_advantages`).

A leaf with tree path (c1, ..., cD) (`algo.tree`, the agent loop's `tree_path` column) draws the noise of steps
[fork_steps[d], fork_steps[d + 1]) as node (c1, ..., c(d+1)): at depth d its advantage is V(c1..c(d+1)) - V(c1..cd),
V a node's mean leaf reward, divided by the standard deviation of those differences over every node of depth d + 1
in the batch (each node once), clipped. The steps before the first fork are every leaf's alike: advantage 0.
"""

from __future__ import annotations

from typing import Sequence

import torch


def node_advantages(rewards: torch.Tensor, groups: Sequence, paths: Sequence[Sequence[int]], adv_clip_max: float = 5.0,
                    eps: float = 1e-4) -> torch.Tensor:
    """[B, D] fp32: row i's advantage at each fork depth d (its node at depth d + 1 against its parent), normalised
    per depth over the batch's nodes. `groups`: each row's tree (the prompt group's uid); `paths`: each row's
    tree path, all of one length D. ValueError naming the argument on mismatched lengths, non-finite rewards or a
    leaf path that occurs twice in one group."""
    r = rewards.detach().double().reshape(-1)
    B = r.numel()
    if len(groups) != B or len(paths) != B:
        raise ValueError(f"groups and paths need one entry per reward ({B}), got {len(groups)} and {len(paths)}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or Inf")
    paths = [tuple(int(c) for c in p) for p in paths]
    D = len(paths[0]) if paths else 0
    if any(len(p) != D for p in paths):
        raise ValueError(f"paths must all have one entry per fork ({D}), got lengths {sorted({len(p) for p in paths})}")
    seen: dict[tuple, int] = {}
    for i, (g, p) in enumerate(zip(groups, paths)):  # a group is one tree: a second leaf at a path is another tree's
        if (g, p) in seen:
            raise ValueError(f"tree_path: rows {seen[(g, p)]} and {i} of group {g!r} are both leaf {list(p)}: a group "
                             f"(uid) must hold one tree, each leaf once (two trees under one uid would be credited as "
                             f"one)")
        seen[(g, p)] = i
    leaves: dict[tuple, list[int]] = {}  # (group, node path prefix) -> its leaves' rows
    for i, (g, p) in enumerate(zip(groups, paths)):
        for d in range(D + 1):
            leaves.setdefault((g, p[:d]), []).append(i)
    value = {node: float(r[rows].mean()) for node, rows in leaves.items()}
    adv = torch.zeros(B, D, dtype=torch.float64)
    for d in range(D):
        nodes = {(g, p[:d + 1]) for g, p in zip(groups, paths)}
        diff = {n: value[n] - value[(n[0], n[1][:-1])] for n in nodes}
        sd = torch.tensor(list(diff.values()), dtype=torch.float64).std(unbiased=False)
        for i, (g, p) in enumerate(zip(groups, paths)):
            adv[i, d] = diff[(g, p[:d + 1])] / (sd + eps)
    return adv.clamp(-adv_clip_max, adv_clip_max).float()


def tree_step_advantages(node_adv: torch.Tensor, fork_steps: Sequence[int], step_indices: torch.Tensor) -> torch.Tensor:
    """[B, W] fp32: each recorded step's advantage (`step_indices` [B, W], the recorded denoising steps): the node
    advantage of the depth whose noise the step drew (the last fork at or before it), 0 before the first fork."""
    forks = torch.tensor(list(fork_steps), dtype=torch.long)
    depth = (step_indices.long().unsqueeze(-1) >= forks).sum(-1) - 1  # [B, W], -1: before the first fork
    padded = torch.cat([torch.zeros(node_adv.shape[0], 1), node_adv.float()], dim=1)  # column 0: depth -1
    return padded.gather(1, depth + 1)
