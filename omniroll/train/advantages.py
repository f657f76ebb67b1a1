"""Rewards into advantages: GRPO's per-group standardisation (flow_grpo's `PerPromptStatTracker`), with the group's
std or the whole batch's (`global_std`, DiffusionNFT's default), clipped; and how many groups tie (they teach
nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] fp32, clipped to +-adv_clip_max
    tied_groups: int  # groups whose rewards all tie (zero advantage: they teach nothing)
    num_groups: int
    tied_rewards: list[float] = field(default_factory=list)  # each tied group's common reward


def group_advantages(rewards: torch.Tensor, groups: Sequence, global_std: bool = False, adv_clip_max: float = 5.0,
                     eps: float = 1e-4) -> Advantages:
    """(r - mean of the row's group) / (std + eps), std of the group (or of the whole batch with `global_std`, as
    flow_grpo's PerPromptStatTracker), clipped to [-adv_clip_max, adv_clip_max]. std is the population std."""
    r = rewards.detach().double().reshape(-1)
    if len(groups) != r.numel():
        raise ValueError(f"groups has {len(groups)} entries for {r.numel()} rewards")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or Inf")
    adv = torch.empty_like(r)
    ids: dict = {}
    for i, g in enumerate(groups):
        ids.setdefault(g, []).append(i)
    tied: list[float] = []
    global_sd = r.std(unbiased=False)
    for rows in ids.values():
        idx = torch.tensor(rows)
        vals = r[idx]
        if bool((vals == vals[0]).all()):
            tied.append(float(vals[0]))
        sd = global_sd if global_std else vals.std(unbiased=False)
        adv[idx] = (vals - vals.mean()) / (sd + eps)
    adv = adv.clamp(-adv_clip_max, adv_clip_max).float()
    return Advantages(adv, len(tied), len(ids), tied)
