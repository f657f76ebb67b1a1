"""The training phase of one step: inner epochs over shuffled micro-batches and every recorded window step, PPO-clip
loss (+ optional KL), gradient accumulation, grad-norm clip, optimizer step. Measures `ratio_max_abs_dev` before the
step's first optimizer update.

With `behaviour_log_probs` (the asynchronous trainer) the loss is decoupled PPO (train/objective.py): the PPO anchor is
the proximal policy (the weights at the start of the step, recomputed without grad; when every micro-batch runs before
the first optimizer update, that is the first pass's own log-prob, detached, bitwise the same), and each window step
is weighted by min(pi_prox / pi_behaviour, behaviour_weight_cap) (the ratio of densities, not of the recorded mean
log-probs: `density_log_ratio_scale`). Without it, the behaviour is the anchor (plain
PPO-clip against the recorded log-probs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniroll.train.grpo import kl_to_reference, ppo_clip_loss
from omniroll.train.objective import decoupled_ppo_loss, density_log_ratio_scale
from omniroll.train.policy import Policy
from omniroll.train.recompute import recompute_log_probs
from omniroll.train.trajectory import TrajectoryBatch


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


def shuffle_generator(seed: int, step: int, epoch: int) -> torch.Generator:
    """Shuffling depends only on (seed, step, epoch): a resumed run shuffles exactly as a straight one."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) * 1009 + int(epoch))


def perm_rows_before_first_update(B: int, seed: int, step: int, micro_batch_size: int, per_update: int) -> set:
    """The rows of epoch 0 scored before its first optimizer update (the first `per_update` micro-batches)."""
    perm = torch.randperm(B, generator=shuffle_generator(seed, step, 0))
    return set(perm[: per_update * micro_batch_size].tolist())


def train_on_batch(policy: Policy, optimizer: torch.optim.Optimizer, traj: TrajectoryBatch, advantages: torch.Tensor,
                   *, step: int, seed: int, num_inner_epochs: int, micro_batch_size: int,
                   micro_batches_per_update: int | None, clip_range: float, kl_beta: float,
                   max_grad_norm: float, behaviour_log_probs: torch.Tensor | None = None,
                   behaviour_weight_cap: float = 2.0, prox_check_rows: int = 0) -> UpdateStats:
    B, W = len(traj), traj.num_steps
    if advantages.shape != (B,):
        raise ValueError(f"advantages must be [{B}], got {tuple(advantages.shape)}")
    params = policy.parameters()
    n_micro = (B + micro_batch_size - 1) // micro_batch_size
    per_update = micro_batches_per_update or n_micro
    dev, clipped, total, kls, approx, losses, plosses, norms = 0.0, 0, 0, [], [], [], [], []
    b_sum, b_dev, capped = 0.0, 0.0, 0
    updates = 0
    prox = None
    if behaviour_log_probs is not None:  # decoupled PPO: pi_prox of every row and step, filled before the first update
        prox = torch.full((B, W), float("nan"))
        # rows seen after the first update, and the check rows (whose anchor is a true no-grad recompute, so
        # ratio_max_abs_dev measures it), are recomputed now
        first = perm_rows_before_first_update(B, seed, step, micro_batch_size, per_update)
        need = sorted((set(range(B)) - first) | set(range(min(prox_check_rows, B))))
        if need:
            with torch.no_grad():
                for chunk in torch.tensor(need).split(micro_batch_size):
                    for k in range(W):
                        prox[chunk, k] = recompute_log_probs(policy.adapter, traj.rows(chunk), k).log_prob.float()
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(num_inner_epochs):
        perm = torch.randperm(B, generator=shuffle_generator(seed, step, epoch))
        chunks = perm.split(micro_batch_size)
        for c, rows in enumerate(chunks):
            mb = traj.rows(rows)
            adv = advantages[rows]
            group_start = (c // per_update) * per_update
            group_size = min(per_update, len(chunks) - group_start)
            for k in range(W):
                out = recompute_log_probs(policy.adapter, mb, k)
                kl = None
                if kl_beta > 0:
                    with torch.no_grad(), policy.reference() as ref:
                        ref_out = recompute_log_probs(ref, mb, k)
                    kl = kl_to_reference(out.mean, ref_out.mean, out.std, mb.sigmas_next[:, k] - mb.sigmas[:, k],
                                         mb.sde_type)
                if prox is None:
                    terms = ppo_clip_loss(out.log_prob, mb.log_probs[:, k], adv, clip_range, kl, kl_beta)
                else:
                    p = prox[rows, k]
                    if updates == 0:  # before the first update: unset rows take this very pass's value
                        p = torch.where(torch.isnan(p), out.log_prob.detach().float(), p)
                        prox[rows, k] = p
                    terms = decoupled_ppo_loss(out.log_prob, p, behaviour_log_probs[rows, k], adv, clip_range,
                                               behaviour_weight_cap, kl, kl_beta,
                                               density_log_ratio_scale(out.std, mb.sde_type, mb.latents[0, k].numel()))
                (terms.loss / (group_size * W)).backward()
                if updates == 0:
                    dev = max(dev, float((terms.ratio - 1.0).abs().max()))
                clipped += int(terms.clipped.sum())
                if terms.behaviour_ratio is not None:
                    b_sum += float(terms.behaviour_ratio.double().sum())
                    b_dev = max(b_dev, float((terms.behaviour_ratio - 1.0).abs().max()))
                    capped += int((terms.behaviour_ratio > behaviour_weight_cap).sum())
                total += len(rows)
                approx.append(float(terms.approx_kl))
                losses.append(float(terms.loss.detach()))
                plosses.append(float(terms.policy_loss))
                kls.append(float(terms.kl))
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
                       behaviour_ratio_mean=b_sum / max(total, 1) if prox is not None else 1.0,
                       behaviour_ratio_max_abs_dev=b_dev, behaviour_weight_capped_frac=capped / max(total, 1))
