"""The update of one step: inner epochs over shuffled micro-batches, each micro-batch's loss terms (the algorithm's:
window steps, training timesteps), gradient accumulation, grad-norm clip, optimizer steps.

The loop is the same for every algorithm (omniroll/train/algorithms/): each loss term's inputs are one `LossInput`
(omniroll/train/algorithms/terms.py), and what a term scored before the first optimizer update returns as
`LossTerms.first_pass` comes back to the same rows' later passes of that term. It measures `ratio_max_abs_dev` (the
maximum of the terms' `deviation` before the first optimizer update: 0.0 when the trained weights compute exactly what
the sampler computed), averages the terms' metrics and sums, per denoising step index, the ratios of the terms that
report their steps (`ratio_steps`: omniroll/train/ratio_steps.py; the loss's own ratios, no extra forward).

Each micro-batch's loss (a mean over its rows) is scaled by its rows' share of its optimizer step (rows / (the step's
rows x terms)), so every optimizer step follows the mean over its rows however the micro-batches were cut
(omniroll/train/micro_batches.py: half by half of the prompt groups, for the gradient-signal meter).

Data-parallel (`GradientShare`, one per rank; omniroll/train/parallel/distributed.py): the rank's rows are a shard of
the step's batch; the step's rows are all ranks' rows in that global optimizer step (`rows_per_update`), the gradients
are summed over the ranks (`all_reduce`) before the clip, and every rank steps its optimizer the same number of times,
with zero gradient for an accumulation group it has no rows in. The update is then the one of the whole batch's row mean
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from omniroll.train.algorithms.base import Algorithm, Anchors, UpdatePlan
from omniroll.train.algorithms.terms import LossInput
from omniroll.train.component_signal import ZERO, ComponentGradients
from omniroll.train.grad_signal import HalfGradient
from omniroll.train.ratio_steps import add_step_sums, ratio_step_sums


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
    # pi_prox / pi_behaviour, the policy's move since the behaviour, over the terms that report it (decoupled PPO: every
    # (row, window step, epoch); GRPO-Guard's stale rows: its ratio before the first update); 1.0 when none does
    behaviour_ratio_mean: float = 1.0
    behaviour_ratio_max_abs_dev: float = 0.0  # max |pi_prox / pi_behaviour - 1|
    behaviour_weight_capped_frac: float = 0.0  # share of (row, window step) terms truncated at behaviour_weight_cap
    scored: int = 0  # (row, term) pairs scored: the weight of this rank's fractions when ranks' stats are merged
    behaviour_scored: int = 0  # of those, the pairs that reported a behaviour ratio: the weight of the behaviour means
    grad_cos: Optional[float] = None  # the gradient-signal meter's reading (omniroll/train/grad_signal.py), or None
    signal_rows_a: int = 0  # the rows of each half the reading compares (all ranks)
    signal_rows_b: int = 0
    # the meter per reward component (omniroll/train/component_signal.py): {function: cos with the total, or None}
    component_cos: dict = field(default_factory=dict)
    # per denoising step index, the sums of the ratios of every (row, term, epoch) that reports its step
    # (omniroll/train/ratio_steps.py; summed over the ranks): {} for an algorithm without a ratio
    ratio_steps: dict = field(default_factory=dict)
    data_loss: Optional[float] = None  # the data regulariser's unweighted loss, mean over optimizer steps (None: off)


@dataclass
class UpdateResult:
    """What the step's update returns (`LocalUpdate.update` in the trainer's process, `RankGroup.update` merged over
    the data-parallel ranks), read by the trainer and the step's record (omniroll/train/report/step_record.py).
    stats: the inner epochs' `UpdateStats`; prepared: the metrics of the algorithm's anchors (`Anchors.metrics`);
    after: its after-update metrics (NFT's old-weight decay); move: how far the update moved the policy
    (omniroll/train/report/policy_move.py); recompute_s: the anchors' seconds; move_s: the policy-move snapshots'
    seconds; peak_bytes: the largest rank's peak device memory in the update (None: the trainer's own `StageMemory`
    measures its process, or the device reports none)."""

    stats: UpdateStats
    prepared: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    move: dict = field(default_factory=dict)
    recompute_s: float = 0.0
    move_s: float = 0.0
    peak_bytes: Optional[int] = None


@dataclass
class GradientShare:
    """One data-parallel rank's part of the update (module doc). rows_per_update: the rows of every global optimizer
    step of an inner epoch (all ranks); all_reduce: sums the parameters' gradients over the ranks, in place;
    all_reduce_tensors: sums plain tensors over the ranks, in place (the meter's copy of half A's gradient)."""

    rows_per_update: Sequence[int]
    all_reduce: Callable[[list], None]
    all_reduce_tensors: Optional[Callable[[list], None]] = None


def train_on_batch(policy, optimizer: torch.optim.Optimizer, algorithm: Algorithm, rows, advantages: torch.Tensor,
                   anchors: Optional[Anchors], plan: UpdatePlan, *, num_inner_epochs: int, max_grad_norm: float,
                   share: Optional[GradientShare] = None) -> UpdateStats:
    """Run the step's update on `rows` (TrajectoryBatch or CleanBatch) with the `anchors` `algorithm.prepare` returned
    (None only for a rank without rows); with `share`, this rank's part of a data-parallel update (module doc). The
    micro-batches are the algorithm's (`Algorithm.micro_batches`; by default cut half by half of the prompt groups
    with `plan.halves`, omniroll/train/micro_batches.py), and with `plan.signal` the gradient-signal meter reads the
    two halves' gradients at the first optimizer step (omniroll/train/grad_signal.py); with `plan.signal` and
    `plan.components`, each component's direction is compared with the total's there too
    (omniroll/train/component_signal.py)."""
    B = len(rows)
    if advantages.shape[:1] != (B,) or advantages.dim() > 2:
        raise ValueError(f"advantages must be [{B}] or [{B}, window steps] (a step-level algorithm's), got "
                         f"{tuple(advantages.shape)}")
    params = policy.parameters()
    dev, clipped, total, kls, approx, losses, plosses, norms = 0.0, 0, 0, [], [], [], [], []
    b_sum, b_dev, capped, b_total = 0.0, 0.0, 0, 0
    step_sums: dict = {}
    first_pass: dict[int, torch.Tensor] = {}  # term -> [B]: what the terms scored before the first update return
    updates = 0
    meter = None
    if plan.signal and plan.halves is not None:
        meter = HalfGradient(params, share.all_reduce_tensors if share is not None else None)
    cos = None
    parts, part_cos = None, {}
    if plan.signal and plan.components:
        parts = ComponentGradients(params, list(plan.components))
        part_adv = {**plan.components, ZERO: torch.zeros_like(advantages)}
    optimizer.zero_grad(set_to_none=True)

    data_losses: list[float] = []

    def optimizer_step():
        nonlocal cos, part_cos
        if share is not None:
            share.all_reduce(params)
        if meter is not None and updates == 0:
            cos = meter.reading()  # the step's first gradient, before the clip
        if parts is not None and updates == 0:
            part_cos = parts.readings(share.all_reduce_tensors if share is not None else None)
        if plan.data_term is not None:  # the data regulariser: once per optimizer step, after the meters' readings
            weighted, raw = plan.data_term(updates)  # (which judge the algorithm's own gradient), before the clip
            weighted.backward()
            data_losses.append(raw)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for epoch in range(num_inner_epochs):
        ep = algorithm.micro_batches(rows, plan, epoch)
        group_rows = share.rows_per_update if share is not None else ep.group_rows()
        for u, group in enumerate(ep.groups):
            for c in group:
                # 1. A micro-batch of the epoch's shuffled rows (half A's before half B's in the first group).
                idx = ep.chunks[c]
                mb = rows.rows(idx)
                adv = advantages[idx]
                if meter is not None and updates == 0:
                    if ep.half_a[c] is False:
                        meter.start_b()
                    meter.count(len(idx), bool(ep.half_a[c]))
                # 2. The algorithm's loss terms (window steps, training timesteps), each backpropagated at once,
                #    weighted by the micro-batch's share of its accumulation group's rows (all ranks').
                T = algorithm.num_terms(mb, anchors)
                for k in range(T):
                    inp = LossInput(policy, mb, idx, adv, k, anchors, plan, epoch=epoch, chunk=c,
                                    first_update=updates == 0,
                                    first_pass=first_pass[k][idx] if k in first_pass else None)
                    terms = algorithm.loss(inp)
                    scale = len(idx) / (group_rows[u] * T)
                    (terms.loss * scale).backward()
                    if parts is not None and updates == 0:  # the same term with each component's advantages
                        for name, a in part_adv.items():
                            parts.add(name, lambda a=a: (algorithm.loss(replace(inp, adv=a[idx])).loss
                                                         * scale).backward())
                    if updates == 0:
                        dev = max(dev, float(terms.deviation.max()))
                        if terms.first_pass is not None:  # handed back to these rows' later passes of term k
                            first_pass.setdefault(k, torch.full((B,), float("nan"), dtype=terms.first_pass.dtype,
                                                                device=terms.first_pass.device))[idx] = terms.first_pass
                    clipped += int(terms.clipped.sum())
                    if terms.behaviour_ratio is not None:
                        b_total += len(idx)
                        b_sum += float(terms.behaviour_ratio.double().sum())
                        b_dev = max(b_dev, float((terms.behaviour_ratio - 1.0).abs().max()))
                        capped += int(terms.behaviour_capped.sum())
                    if terms.steps is not None and terms.ratio is not None:
                        add_step_sums(step_sums, ratio_step_sums(terms.steps, terms.log_ratio, terms.log_prob_diff,
                                                                 terms.ratio, terms.clipped))
                    total += len(terms.clipped)  # (row, timestep) pairs: a term may stack several timesteps
                    approx.append(float(terms.approx_kl))
                    losses.append(float(terms.loss.detach()))
                    plosses.append(float(terms.policy_loss))
                    kls.append(float(terms.kl))
            # 3. At the end of an accumulation group: clip the gradient, step the optimizer.
            optimizer_step()
            updates += 1
        # 4. Data-parallel: the global steps this rank has no rows in (its gradient is zero; the others' is not).
        for _ in range(len(ep.groups), len(share.rows_per_update) if share is not None else 0):
            optimizer_step()
            updates += 1

    def mean(x):
        return sum(x) / max(len(x), 1)

    return UpdateStats(ratio_max_abs_dev=dev, clip_frac=clipped / max(total, 1), approx_kl=mean(approx),
                       loss=mean(losses), policy_loss=mean(plosses), kl=mean(kls), grad_norm=mean(norms),
                       optimizer_steps=updates,
                       behaviour_ratio_mean=b_sum / b_total if b_total else 1.0,
                       behaviour_ratio_max_abs_dev=b_dev, behaviour_weight_capped_frac=capped / max(b_total, 1),
                       scored=total, behaviour_scored=b_total, grad_cos=cos,
                       signal_rows_a=meter.rows_a if meter is not None else 0,
                       signal_rows_b=meter.rows_b if meter is not None else 0, ratio_steps=step_sums,
                       component_cos=part_cos, data_loss=mean(data_losses) if data_losses else None)
