"""AWM, Advantage Weighted Matching (arXiv 2509.25050; scxue/advantage_weighted_matching `scripts/train_sd3_awm.py`):
the policy gradient of a diffusion model written as flow matching weighted by the advantage.

Rollout: the clean latents of a CFG-off ODE (omniroll/train/algorithms/forward.py). Advantages: per prompt group,
clipped at adv_clip_max and divided by it (the reference's advantage_max 1). Per row and training timestep t
(`train_timesteps` of its sampling timesteps after the first, fresh eps each):

    l     = mean((v_theta(x_t, t) - (eps - x0))^2)                 the flow-matching error
    logp  = -w(l, t),  w = (t / p) ((l + e)^p - e^p)  (ghuber)  or  t l  (mse)
    ratio = exp(logp - logp.detach())                               on-policy: 1 in value
    loss  = mean_rows(-A ratio) + kl_beta mean((v_theta - v_base)^2)

The gradient is mean(A grad w(l, t)): advantage-weighted flow matching (with `mse`, exactly flow matching's gradient
scaled per row by A t). The reference's PPO clip does not act on-policy (its ratio is 1 by construction, and its
clip_range 1 "currently does not work"), so it is left out; `ratio_max_abs_dev` reports |ratio - 1| (0.0).
Not implemented: the reference's EMA-KL term (a velocity KL to an EMA of the trained weights, decay ramping to 0.3);
the KL here is to the base model only.
"""

from __future__ import annotations

import torch

from omniroll.train.algorithms.forward import ForwardProcessAlgorithm
from omniroll.train.algorithms.terms import LossInput, LossTerms, gated, with_kl
from omniroll.train.clean_batch import CleanBatch


def awm_weight(err: torch.Tensor, t: torch.Tensor, weighting: str, p: float, e: float) -> torch.Tensor:
    """w(l, t) [B] from the per-row flow-matching error l [B] and t [B]."""
    t = t.to(err.dtype)
    if weighting == "mse":
        return t * err
    return (t / p) * ((err + e) ** p - e**p)


def awm_policy_loss(v: torch.Tensor, target: torch.Tensor, t: torch.Tensor, adv: torch.Tensor, weighting: str,
                    p: float, e: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, ratio [B]) of one (micro-batch, timestep) (module doc); adv: the normalised advantages."""
    B = v.shape[0]
    err = ((v - target) ** 2).reshape(B, -1).mean(1)
    logp = -awm_weight(err, t, weighting, p, e)
    ratio = torch.exp(logp - logp.detach())
    return torch.mean(-adv.to(v.dtype) * ratio), ratio.detach()


class AWM(ForwardProcessAlgorithm):
    name = "awm"
    skip_first_timestep = True

    def timesteps_per_row(self, rows: CleanBatch) -> int:
        return self.options.train_timesteps

    def loss(self, inp: LossInput) -> LossTerms:
        o, tc, policy = self.options, self.tc, inp.policy
        n = self.noised(inp)  # the term's rows: one forward
        mb, adv, t, x_t = n.rows, n.adv, n.t, n.x_t
        v = mb.velocity(policy.adapter, x_t, t)
        policy_loss, ratio = awm_policy_loss(v, n.eps - mb.x0, t, adv / tc.adv_clip_max, o.weighting, o.huber_p,
                                             o.huber_eps)
        kl = gated(self.kl_to_base(policy, mb, x_t, t, v), n.kl_gate)
        loss, kl_term = with_kl(policy_loss, kl, tc.kl_beta)
        loss, policy_loss, kl_term = n.weighed(loss, policy_loss, kl_term)
        return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio,
                         clipped=torch.zeros(len(mb), dtype=torch.bool), approx_kl=torch.zeros(()))
