"""GRPO-Guard (arXiv 2510.22319; verl-omni `GRPOGuardLoss`): Flow-GRPO with the per-step ratio normalised (RatioNorm)
and the loss reweighted by the step size.

Flow-GRPO's log-ratio of a Flow-SDE step is biased below 0: with x' = mu_old + s xi (s the transition std, the same
for both policies), logp_theta - logp_old = -mean(xi (mu_old - mu_theta)) / s - mean((mu_theta - mu_old)^2) / (2 s^2),
whose mean over the noise is -||dmu||^2 / 2s^2 < 0, worst at the low-noise steps, so clipping fails to bound the
updates of positive advantages. GRPO-Guard adds the bias back and rescales by s:

    bias      = mean((mu_theta - mu_old)^2) / (2 s^2)
    log ratio = (logp_theta - logp_old + bias) * s          ( = mean(xi (mu_theta - mu_old)): zero-mean over xi )
    loss      = mean(max(-A r, -A clip(r, 1 +- eps))) / mean(sqrt(sigma_i - sigma_{i+1}))^2  (+ kl_beta KL)

mu_old is the behaviour's transition mean, recomputed under the weight version that ran each window step (exactly the
rollout's, by batch invariance). Rollout: Flow-SDE only (`algo.sde_type: sde`). Reference default clip_range 2e-6
(verl-omni's recipe). With max_staleness >= 1 the behaviour is the anchor (no decoupled weight), and
`ratio_max_abs_dev` compares the behaviour's recompute with the recorded log-prob, as for every algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from omniroll.train.algorithms.base import UpdatePlan
from omniroll.train.algorithms.flow_grpo import FlowGRPO, WindowAnchors
from omniroll.train.algorithms.ppo import clipped_surrogate
from omniroll.train.algorithms.terms import LossInput, LossTerms, gated, with_kl
from omniroll.train.recompute import recompute_log_probs
from omniroll.train.trajectory_batch import TrajectoryBatch
from omniroll.train.behaviour_log_probs import log_probs_under_versions


def guard_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """[B] RatioNorm's log-ratio (module doc) from Flow-GRPO's mean log-probs, the two transition means and the
    transition std s [B]."""
    B = mean.shape[0]
    s = std.reshape(B).to(mean.dtype)
    bias = ((mean - old_mean) ** 2).reshape(B, -1).mean(1) / (2 * s**2)
    return (log_prob - old_log_prob + bias) * s


def guard_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float, sqrt_dt: torch.Tensor,
               kl=None, kl_beta: float = 0.0) -> LossTerms:
    """The clipped surrogate on exp(log_ratio), divided by mean(sqrt_dt)^2 (the reference's step reweighting)."""
    ratio = torch.exp(log_ratio)
    policy_loss = torch.mean(clipped_surrogate(ratio, advantages, clip_range)) / sqrt_dt.mean() ** 2
    loss, kl_term = with_kl(policy_loss, kl, kl_beta)
    d = log_ratio.detach()
    return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio.detach(),
                     clipped=(ratio.detach() - 1.0).abs() > clip_range, approx_kl=0.5 * torch.mean(d * d), log_ratio=d)


@dataclass
class GuardAnchors(WindowAnchors):
    """Flow-GRPO's anchors and old_mean [B, W, ...]: the behaviour's transition mean of every window step, under the
    version that ran it."""

    old_mean: Optional[torch.Tensor] = None


class GRPOGuard(FlowGRPO):
    name = "grpo_guard"

    def prepare(self, policy, rows: TrajectoryBatch, plan: UpdatePlan) -> GuardAnchors:
        window = super().prepare(policy, rows, plan)
        old_mean = log_probs_under_versions(plan.store, rows, plan.versions, plan.micro_batch_size, "mean")
        return GuardAnchors(metrics=window.metrics, steps_of=window.steps_of, behaviour=window.behaviour,
                            prox=window.prox, old_mean=old_mean)

    def loss(self, inp: LossInput) -> LossTerms:
        anchors, idx, mb = inp.anchors, inp.idx, inp.mb
        steps = anchors.steps_of[idx, inp.term]
        view = mb.at_steps(steps)
        out = recompute_log_probs(inp.policy.adapter, view, 0)
        old = view.log_probs[:, 0] if anchors.behaviour is None else anchors.behaviour[idx, steps]
        log_ratio = guard_log_ratio(out.log_prob, old, out.mean, anchors.old_mean[idx, steps], out.std)
        sqrt_dt = torch.sqrt(torch.clamp(view.sigmas[:, 0] - view.sigmas_next[:, 0], min=0.0))
        terms = guard_loss(log_ratio, inp.adv, self.tc.clip_range, sqrt_dt,
                           gated(self.kl(inp.policy, view, out), inp.kl_gate), self.tc.kl_beta)
        extra = {"steps": mb.denoising_steps(steps),  # the per-timestep statistics (omniroll/train/ratio_steps.py)
                 "log_prob_diff": (out.log_prob - old).detach()}  # the un-normalised difference its ratio is built from
        if anchors.behaviour is not None:
            # Stale rows: the ratio's anchor is the behaviour, so before the first update (theta = the step's proximal
            # weights) the ratio is the policy's move since the behaviour: logged under its own name,
            # behaviour_ratio_max_abs_dev (never truncated: no decoupled weight). ratio_max_abs_dev stays the
            # exactness check every algorithm logs: the recompute under the behaviour's version against the recorded
            # log-prob (0.0 on CPU).
            if inp.first_update:
                extra.update(behaviour_ratio=terms.ratio, behaviour_capped=torch.zeros_like(terms.clipped))
            extra["deviation"] = (torch.exp(old - view.log_probs[:, 0]) - 1.0).abs()
        return replace(terms, **extra)
