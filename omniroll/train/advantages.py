"""Rewards into advantages: GRPO's per-group standardisation (flow_grpo's `PerPromptStatTracker`), with the group's
std or the whole batch's (`global_std`, DiffusionNFT's default), clipped; GDPO's per-function normalisation
(`reward.aggregation: gdpo`, `gdpo_advantages`); how many groups tie (they teach nothing); and each reward function's
own advantages, normalised as the aggregation normalises them (`component_advantages`, for the per-component
gradient-signal meter)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from omniroll.reward.aggregation import EPS, check_components, gdpo_scores, group_rows


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] fp32 ([B, W]: one per window step, tree_grpo's), clipped to +-adv_clip_max
    tied_groups: int  # groups whose rewards all tie (zero advantage: they teach nothing)
    num_groups: int
    tied_rewards: list[float] = field(default_factory=list)  # each tied group's common reward
    metrics: dict = field(default_factory=dict)  # what the estimator adds to the step's record (gdpo: per function)


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


def batch_components(batch, names: Sequence[str]) -> dict[str, list[float]]:
    """Each reward function's own score per row of a rollout batch (its rows' `reward_extra_info["components"]`),
    as function -> [B]; a row without one of `names` is a ValueError naming the function and the sample
    (`omniroll.reward.aggregation.check_components`)."""
    infos = batch.non_tensor_batch.get("reward_extra_info")
    n = len(batch)
    infos = list(infos) if infos is not None else [None] * n
    ids = list(batch.non_tensor_batch.get("request_id", [f"row {i}" for i in range(n)]))
    rows = [dict((info or {}).get("components") or {}) if isinstance(info, dict) else {} for info in infos]
    return check_components(rows, list(names), [str(i) for i in ids])


def gdpo_advantages(components: dict[str, Sequence[float]], weights: dict[str, float], groups: Sequence,
                    rewards: torch.Tensor, adv_clip_max: float = 5.0, eps: float = EPS) -> Advantages:
    """`reward.aggregation: gdpo`: GDPO's aggregated score (`omniroll.reward.aggregation.gdpo_scores`: each
    function normalised within its group, weighted sum, whitened over the batch) IS the advantage, clipped to
    [-adv_clip_max, adv_clip_max]. It is not group-normalised again: each group's weighted sum already has mean 0, and
    dividing it by its own group's std would re-couple the components (a group where only a low-spread function
    varies would be blown up to the same scale as one where every function varies), the drowning GDPO removes.
    tied groups: groups where every function ties (all zeros: they teach nothing); `metrics`: each function's
    `gdpo/<fn>/group_std` (its mean within-group std) and `gdpo/<fn>/tied_groups`."""
    if len(groups) != len(rewards):
        raise ValueError(f"groups has {len(groups)} entries for {len(rewards)} rewards")
    out = gdpo_scores(components, weights, groups, eps)
    tied = [float(rewards[rows[0]]) for rows in group_rows(groups)
            if all(len(set(components[k][i] for i in rows)) == 1 for k in components)]
    adv = torch.from_numpy(out.scores).clamp(-adv_clip_max, adv_clip_max).float()
    metrics = {**{f"gdpo/{k}/group_std": v for k, v in out.group_std.items()},
               **{f"gdpo/{k}/tied_groups": v for k, v in out.tied_groups.items()}}
    return Advantages(adv, len(tied), len(group_rows(groups)), tied, metrics)


def component_advantages(components: dict[str, Sequence[float]], weights: dict[str, float], groups: Sequence,
                         aggregation: str, global_std: bool = False,
                         adv_clip_max: float = 5.0) -> dict[str, torch.Tensor]:
    """Each reward function's own advantages [B] fp32, as if it were the only one, normalised the way `aggregation`
    normalises the total: `sum`, its weighted score w_k r_k standardised per group (`group_advantages`, with
    `global_std`); `gdpo`, `gdpo_advantages` of that one function (normalised within its group, weighted, whitened).
    Clipped to +-adv_clip_max as the total is. The weight's sign is kept (a negative weight trains against the
    score); a function of weight 0 is left out (it is logged, never trained)."""
    if aggregation not in ("sum", "gdpo"):
        raise ValueError(f"aggregation must be sum or gdpo, got {aggregation!r}")
    out = {}
    for name, values in components.items():
        w = float(weights[name])
        if w == 0.0:
            continue
        if aggregation == "gdpo":
            r = torch.tensor(values, dtype=torch.float64)
            out[name] = gdpo_advantages({name: values}, {name: w}, groups, r, adv_clip_max).advantages
        else:
            r = w * torch.tensor(values, dtype=torch.float64)
            out[name] = group_advantages(r, groups, global_std, adv_clip_max).advantages
    return out
