"""The PPO-clip terms the log-prob algorithms share (Flow-GRPO, DanceGRPO; GRPO-Guard builds its own ratio): the clipped
surrogate against the recorded log-prob (`ppo_clip_loss`), the asynchronous trainer's decoupled PPO
(`decoupled_ppo_loss`, with `density_log_ratio_scale`), and the KL to the reference (`kl_to_reference`); each returns
the `LossTerms` every algorithm's loss returns (omniroll/train/algorithms/terms.py, with `with_kl`).

Decoupled PPO, per window step k of a row (A: its advantage, eps: clip_range, c: behaviour_weight_cap):

    w     = min(pi_prox / pi_behaviour, c)              (no grad)
    r     = pi_theta / pi_prox
    loss  = mean_rows( w * max(-A r, -A clip(r, 1 - eps, 1 + eps)) )

pi_behaviour: the policy that sampled the step (the engine's recorded log-prob, or a recompute under its version);
pi_prox: the trainer's weights at the start of the step (recomputed without grad, in the rollout's execution mode);
pi_theta: the weights being trained. When every step ran with the trainer's current weights (max_staleness 0),
pi_prox == pi_behaviour bitwise, so w == 1.0 exactly and the loss is `ppo_clip_loss`'s, bit for bit.

w is the ratio of the two policies' densities of the step's transition. A recorded log-prob is Flow-GRPO's mean over
the latent's D elements, so w = exp(D * (mean log pi_prox - mean log pi_behaviour)) (`density_log_ratio_scale`; for
cps, whose log-prob is minus the mean squared error, D / (2 std^2)). The ratio of the means themselves, the D-th
root of w, stayed within 0.5 % of 1 on the demo one version apart while log w averaged 0.16-0.5 in absolute value and
w reached 414, so used as w it corrected nothing. r keeps Flow-GRPO's mean convention (clip_range is set for it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from omniroll.train.algorithms.terms import LossTerms, with_kl


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """PPO-clip's surrogate per element, max(-A r, -A clip(r, 1 +- eps)): the one place every ratio loss takes it."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped)


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                  kl: torch.Tensor | None = None, kl_beta: float = 0.0) -> LossTerms:
    """flow_grpo's loss for one window step: mean(max(-A r, -A clip(r, 1 +- eps))) + beta * KL."""
    ratio = torch.exp(log_prob - old_log_prob)
    policy_loss = torch.mean(clipped_surrogate(ratio, advantages, clip_range))
    loss, kl_term = with_kl(policy_loss, kl, kl_beta)
    d = (log_prob - old_log_prob).detach()
    return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio.detach(),
                     clipped=(ratio.detach() - 1.0).abs() > clip_range, approx_kl=0.5 * torch.mean(d * d), log_ratio=d)


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, dt: torch.Tensor,
                    sde_type: Sequence[str]) -> torch.Tensor:
    """flow_grpo's KL per row: mean((mu - mu_ref)^2) / (2 std_t^2), with std_t its `std_dev_t`: the transition std s
    for cps / dance_sde, s / sqrt(-dt) for sde (so, like flow_grpo, it omits |dt| for `sde`)."""
    B = mean.shape[0]
    sq = ((mean - ref_mean) ** 2).reshape(B, -1).mean(1)
    is_sde = torch.tensor([t == "sde" for t in sde_type], device=std.device)
    std_t = torch.where(is_sde, std / torch.sqrt(torch.clamp(-dt, min=1e-12)), std)
    return sq / (2 * torch.clamp(std_t, min=1e-12) ** 2)


# ------------------------------------------------------------------------------- the off-policy (decoupled) loss
def decoupled_ppo_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                       advantages: torch.Tensor, clip_range: float, behaviour_weight_cap: float,
                       kl: Optional[torch.Tensor] = None, kl_beta: float = 0.0,
                       log_ratio_scale: torch.Tensor | float = 1.0) -> LossTerms:
    """Decoupled PPO-clip for one window step (see the module doc). `ratio`, `clipped` and `approx_kl` are measured
    against pi_prox (the PPO anchor). log_ratio_scale ([B] or a float): turns prox_log_prob - behaviour_log_prob into
    the log of the density ratio pi_prox / pi_behaviour (1.0 for log densities; `density_log_ratio_scale` for the
    recorded mean log-probs)."""
    log_w = torch.as_tensor(log_ratio_scale, dtype=torch.float64) * (prox_log_prob - behaviour_log_prob).detach(
    ).double()  # fp64: a large ratio stays finite in the metrics
    behaviour_ratio = torch.exp(log_w)
    w = behaviour_ratio.clamp(max=behaviour_weight_cap).to(log_prob.dtype)
    ratio = torch.exp(log_prob - prox_log_prob)
    policy_loss = torch.mean(w * clipped_surrogate(ratio, advantages, clip_range))
    loss, kl_term = with_kl(policy_loss, kl, kl_beta)
    d = (log_prob - prox_log_prob).detach()
    return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio.detach(),
                     clipped=(ratio.detach() - 1.0).abs() > clip_range, approx_kl=0.5 * torch.mean(d * d),
                     behaviour_ratio=behaviour_ratio, behaviour_capped=behaviour_ratio > behaviour_weight_cap,
                     log_ratio=d)


def density_log_ratio_scale(std: torch.Tensor, sde_type: list[str], numel: int) -> torch.Tensor:
    """[B] factor from a difference of two policies' recorded log-probs of one window step (each the mean over the
    latent's `numel` elements, Flow-GRPO's convention, with the same std: it does not depend on the weights) to the log
    of their density ratio: numel for a Gaussian step (sde, dance_sde), numel / (2 std^2) for cps (whose recorded
    log-prob is minus the mean squared error)."""
    cps = torch.tensor([t == "cps" for t in sde_type], device=std.device)
    std = std.detach().double().reshape(-1)
    return torch.where(cps, numel / (2 * std.clamp(min=1e-12) ** 2), torch.full_like(std, float(numel)))
