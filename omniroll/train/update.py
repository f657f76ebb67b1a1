"""The update of one step: inner epochs over shuffled micro-batches, each micro-batch's loss terms (the algorithm's:
window steps, training timesteps), gradient accumulation, grad-norm clip, optimizer steps.

The loop is the same for every algorithm (omniroll/train/algorithms/); it measures `ratio_max_abs_dev` (the maximum
of the terms' `deviation` before the first optimizer update: 0.0 when the trained weights compute exactly what the
sampler computed) and averages the terms' metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniroll.train.algorithms.base import Algorithm, UpdatePlan, shuffle_generator


@dataclass
class UpdateStats:
    ratio_max_abs_dev: float
    clip_frac: float
    approx_kl: float
    loss: float
    policy_loss: float
    kl: float
    grad_norm: float
    optimizer_steps: int
    behaviour_ratio_mean: float = 1.0  # pi_prox / pi_behaviour over every (row, window step, epoch); 1.0 when plain
    behaviour_ratio_max_abs_dev: float = 0.0  # max |pi_prox / pi_behaviour - 1|
    behaviour_weight_capped_frac: float = 0.0  # share of (row, window step) terms truncated at behaviour_weight_cap


def train_on_batch(policy, optimizer: torch.optim.Optimizer, algorithm: Algorithm, rows, advantages: torch.Tensor,
                   plan: UpdatePlan, *, num_inner_epochs: int, max_grad_norm: float) -> UpdateStats:
    """Run the step's update on `rows` (TrajectoryBatch or CleanBatch) after `algorithm.prepare`."""
    B = len(rows)
    if advantages.shape != (B,):
        raise ValueError(f"advantages must be [{B}], got {tuple(advantages.shape)}")
    params = policy.parameters()
    per_update = plan.per_update
    cap = getattr(algorithm.tc, "behaviour_weight_cap", float("inf"))
    dev, clipped, total, kls, approx, losses, plosses, norms = 0.0, 0, 0, [], [], [], [], []
    b_sum, b_dev, capped, decoupled = 0.0, 0.0, 0, False
    updates = 0
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(num_inner_epochs):
        perm = torch.randperm(B, generator=shuffle_generator(plan.seed, plan.step, epoch))
        chunks = perm.split(plan.micro_batch_size)
        for c, idx in enumerate(chunks):
            # 1. A micro-batch of the epoch's shuffled rows, and its place in its gradient-accumulation group.
            mb = rows.rows(idx)
            adv = advantages[idx]
            group_start = (c // per_update) * per_update
            group_size = min(per_update, len(chunks) - group_start)
            # 2. The algorithm's loss terms (window steps, training timesteps), each backpropagated at once.
            T = algorithm.num_terms(mb)
            for k in range(T):
                terms = algorithm.loss(policy, mb, idx, adv, k, plan, epoch=epoch, chunk=c,
                                       first_update=updates == 0)
                (terms.loss / (group_size * T)).backward()
                if updates == 0:
                    dev = max(dev, float(terms.deviation.max()))
                clipped += int(terms.clipped.sum())
                if terms.behaviour_ratio is not None:
                    decoupled = True
                    b_sum += float(terms.behaviour_ratio.double().sum())
                    b_dev = max(b_dev, float((terms.behaviour_ratio - 1.0).abs().max()))
                    capped += int((terms.behaviour_ratio > cap).sum())
                total += len(idx)
                approx.append(float(terms.approx_kl))
                losses.append(float(terms.loss.detach()))
                plosses.append(float(terms.policy_loss))
                kls.append(float(terms.kl))
            # 3. At the end of an accumulation group: clip the gradient, step the optimizer.
            if (c + 1) % per_update == 0 or c == len(chunks) - 1:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                updates += 1

    def mean(x):
        return sum(x) / max(len(x), 1)

    return UpdateStats(ratio_max_abs_dev=dev, clip_frac=clipped / max(total, 1), approx_kl=mean(approx),
                       loss=mean(losses), policy_loss=mean(plosses), kl=mean(kls), grad_norm=mean(norms),
                       optimizer_steps=updates,
                       behaviour_ratio_mean=b_sum / max(total, 1) if decoupled else 1.0,
                       behaviour_ratio_max_abs_dev=b_dev, behaviour_weight_capped_frac=capped / max(total, 1))
