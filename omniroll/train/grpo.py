"""GRPO's pure pieces, with flow_grpo's definitions: per-group advantages and the PPO-clip / KL loss terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] fp32, clipped to +-adv_clip_max
    tied_groups: int  # groups whose rewards all tie (zero advantage: they teach nothing)
    num_groups: int


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
    tied = 0
    global_sd = r.std(unbiased=False)
    for rows in ids.values():
        idx = torch.tensor(rows)
        vals = r[idx]
        if bool((vals == vals[0]).all()):
            tied += 1
        sd = global_sd if global_std else vals.std(unbiased=False)
        adv[idx] = (vals - vals.mean()) / (sd + eps)
    adv = adv.clamp(-adv_clip_max, adv_clip_max).float()
    return Advantages(adv, tied, len(ids))


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, with grad
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor  # [B] detached
    clipped: torch.Tensor  # [B] bool: |ratio - 1| > clip_range
    approx_kl: torch.Tensor  # scalar: 0.5 mean((logp - old)^2)
    behaviour_ratio: torch.Tensor | None = None  # [B] pi_prox / pi_behaviour before truncation (decoupled PPO only)


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                  kl: torch.Tensor | None = None, kl_beta: float = 0.0) -> LossTerms:
    """flow_grpo's loss for one window step: mean(max(-A r, -A clip(r, 1 +- eps))) + beta * KL."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped))
    kl_term = kl.mean() if kl is not None else torch.zeros((), dtype=policy_loss.dtype)
    loss = policy_loss + kl_beta * kl_term if kl is not None and kl_beta > 0 else policy_loss
    d = (log_prob - old_log_prob).detach()
    return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio.detach(),
                     clipped=(ratio.detach() - 1.0).abs() > clip_range, approx_kl=0.5 * torch.mean(d * d))


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, dt: torch.Tensor,
                    sde_type: Sequence[str]) -> torch.Tensor:
    """flow_grpo's KL per row: mean((mu - mu_ref)^2) / (2 std_t^2), with std_t its `std_dev_t`: the transition std s
    for cps / dance_sde, s / sqrt(-dt) for sde (so, like flow_grpo, it omits |dt| for `sde`)."""
    B = mean.shape[0]
    sq = ((mean - ref_mean) ** 2).reshape(B, -1).mean(1)
    is_sde = torch.tensor([t == "sde" for t in sde_type])
    std_t = torch.where(is_sde, std / torch.sqrt(torch.clamp(-dt, min=1e-12)), std)
    return sq / (2 * torch.clamp(std_t, min=1e-12) ** 2)
