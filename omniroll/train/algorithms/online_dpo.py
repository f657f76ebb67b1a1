"""Online Diffusion-DPO: Diffusion-DPO's preference loss (Wallace et al., arXiv 2311.12908) on pairs formed online
within each prompt group (its best sample the winner, its worst the loser, both from the policy's own rollout), against
the base model (the adapter off) as the reference. The worked example of docs/training/algorithms.md's "Writing one":
this file and its entry in `ALGORITHMS` (omniroll/config/algorithms.py) are the whole algorithm.

Rollout: the forward-process one (omniroll/train/algorithms/forward.py): the clean latent x0 of a CFG-off ODE, no
log-probs. Advantages: per prompt group (the shared default); a group's winner is its row of largest advantage, its
loser its row of smallest, and a group whose samples all tie gives no pair. Micro-batches keep every group whole
(`whole_group_micro_batches`), so a pair is scored in one micro-batch. Per row and training timestep t
(`train_timesteps` of its sampling timesteps after the first, sigma 1 being pure noise; fresh eps each, as AWM draws
them):

    e(v)  = mean((v(x_t, t) - (eps - x0))^2),  x_t = (1 - t) x0 + t eps     the flow-matching error
    d     = e(v_theta) - e(v_ref)                                           (v_ref: the base model, no grad)
    loss  = sum over pairs of -log sigmoid(-beta (d_winner - d_loser)) / rows  (+ kl_beta mean((v_theta - v_ref)^2))

so the policy lowers its error on the winner and raises it on the loser, each against the reference. At theta = ref
(a LoRA run's first step) every d is 0, each pair's loss is log 2 and its gradient beta / 2 (grad e_winner -
grad e_loser): advantage-signed flow matching on the pair.

Not the reference: Diffusion-DPO trains offline preference pairs (Pick-a-Pic) sharing one noise and timestep per
pair, on the epsilon error with beta 5000 (SD 1.5); here the pairs are online, each row has its own timesteps and
noise, the error is the velocity's, and `beta`'s default is not tuned. `ratio_max_abs_dev` is 0.0 by construction:
the loss compares the policy with the reference, never with the sampler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniroll.train.algorithms.base import UpdatePlan, shuffle_generator
from omniroll.train.algorithms.forward import ForwardProcessAlgorithm
from omniroll.train.algorithms.terms import LossInput, LossTerms, gated, with_kl
from omniroll.train.clean_batch import CleanBatch
from omniroll.train.micro_batches import EpochPlan, whole_group_micro_batches


def velocity_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B] the flow-matching error per row, mean((v - target)^2) over its elements."""
    return ((v - target) ** 2).reshape(v.shape[0], -1).mean(1)


def preference_pairs(adv: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(winners, losers), long [P]: for each key (a prompt group) with untied rows, its row of largest advantage and
    its row of smallest (the first of equals), in the order of the keys' first rows."""
    winners, losers = [], []
    for k in dict.fromkeys(keys.tolist()):
        rows = torch.nonzero(keys == k).flatten()
        a = adv[rows]
        w, lo = rows[int(torch.argmax(a))], rows[int(torch.argmin(a))]
        if bool(adv[w] > adv[lo]):
            winners.append(int(w))
            losers.append(int(lo))
    return torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long)


def dpo_loss(d: torch.Tensor, winners: torch.Tensor, losers: torch.Tensor, beta: float) -> torch.Tensor:
    """sum over pairs of -log sigmoid(-beta (d[winner] - d[loser])), divided by the rows of `d` (a row mean, as every
    term's loss is: the update loop weighs it by its rows); 0 with a gradient of 0 when there is no pair."""
    if len(winners) == 0:
        return d.sum() * 0.0
    return -F.logsigmoid(-beta * (d[winners] - d[losers])).sum() / len(d)


class OnlineDPO(ForwardProcessAlgorithm):
    name = "online_dpo"
    skip_first_timestep = True  # sigma 1 is pure noise: no sample's velocity there says which one is better

    def timesteps_per_row(self, rows: CleanBatch) -> int:
        return self.options.train_timesteps

    def micro_batches(self, rows, plan: UpdatePlan, epoch: int) -> EpochPlan:
        """Every prompt group whole in one micro-batch (a pair is scored together), the groups shuffled per epoch."""
        if plan.groups is None:
            raise ValueError("trainer.algorithm online_dpo: the update plan names no prompt groups (UpdatePlan.groups)")
        return whole_group_micro_batches(plan.groups, plan.halves, plan.micro_batch_size, plan.per_update,
                                         shuffle_generator(plan.seed, plan.step, epoch))

    def loss(self, inp: LossInput) -> LossTerms:
        o, tc = self.options, self.tc
        n = self.noised(inp)  # the term's rows (its timesteps stacked): one forward
        mb, t, x_t = n.rows, n.t, n.x_t
        target = n.eps - mb.x0
        v = mb.velocity(inp.policy.adapter, x_t, t)
        with torch.no_grad(), inp.policy.reference() as ref:
            v_ref = mb.velocity(ref, x_t, t)
        B = len(mb)
        d = velocity_error(v, target) - velocity_error(v_ref, target)
        # a pair is two rows of one prompt group at one stacked timestep
        b = len(inp.idx)
        group = inp.plan.groups[inp.idx.cpu()].repeat(B // b)
        keys = group + (torch.arange(B) // b) * (int(group.max()) + 1)
        winners, losers = preference_pairs(n.adv.detach().cpu(), keys)
        policy_loss = dpo_loss(d, winners.to(d.device), losers.to(d.device), o.beta)
        kl = gated(((v - v_ref) ** 2).reshape(B, -1).mean(1), n.kl_gate) if tc.kl_beta > 0 else None
        loss, kl_term = with_kl(policy_loss, kl, tc.kl_beta)
        loss, policy_loss, kl_term = n.weighed(loss, policy_loss, kl_term)
        return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=None,
                         clipped=torch.zeros(B, dtype=torch.bool), approx_kl=torch.zeros(()),
                         deviation=torch.zeros(B))
