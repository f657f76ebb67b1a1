"""What an algorithm's loss takes and returns: `LossInput` (one loss term's inputs, in one typed object), `LossTerms`
(its loss and the metrics the update loop reads), `with_kl` (the KL tail every algorithm adds the same way) and
`gated` (the KL per row under `trainer.kl_gate`).

The update loop (omniroll/train/update.py) builds one `LossInput` per (micro-batch, loss term) and calls
`algorithm.loss(inp)`; the loss reads its inputs and writes nothing back: the anchors `prepare` returned are read-only,
and what a term measures before the step's first optimizer update that a later pass of the same rows reads (decoupled
PPO's proximal log-prob of the rows scored before that update) goes back to the loop as `LossTerms.first_pass`, which
hands it to that later pass as `LossInput.first_pass`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class LossInput:
    """One loss term's inputs. policy: the trained `Policy`; mb: the micro-batch's rows (TrajectoryBatch or
    CleanBatch); idx: their indices in the step's batch; adv: their advantages ([b], or [b, W] for a step-level
    algorithm); term: the loss term (< `num_terms`); anchors: what `prepare` returned (read-only); plan: the step's
    `UpdatePlan`; epoch, chunk: the inner epoch and the micro-batch's index in it (what fresh noise is seeded by);
    first_update: no optimizer update of the step has run yet; first_pass: [b], what this term returned as
    `LossTerms.first_pass` for these rows in the step's first pass (NaN for rows it did not score then; None when it
    returned none)."""

    policy: Any
    mb: Any
    idx: torch.Tensor
    adv: torch.Tensor
    term: int
    anchors: Any  # the algorithm's `Anchors` (base.py, which imports this file)
    plan: Any  # the step's `UpdatePlan` (base.py)
    epoch: int = 0
    chunk: int = 0
    first_update: bool = True
    first_pass: Optional[torch.Tensor] = None

    @property
    def kl_gate(self) -> Optional[torch.Tensor]:
        """[b] of 0 / 1: whether each of these rows' KL counts (`trainer.kl_gate`); None: every row's."""
        gate = getattr(self.plan, "kl_gate", None)
        return None if gate is None else gate[self.idx.cpu()].to(self.adv.device)


@dataclass(frozen=True)
class LossTerms:
    """One loss term of a micro-batch (every algorithm's `loss` returns it; frozen: build another with
    `dataclasses.replace`). `deviation` [B]: what the step's exactness metric `ratio_max_abs_dev` takes the maximum of
    before the first optimizer update (|ratio - 1| for the log-prob algorithms; the algorithm says what for the
    others)."""

    loss: torch.Tensor  # scalar, with grad
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio: Optional[torch.Tensor]  # [B] detached (None: the algorithm has no likelihood ratio)
    clipped: torch.Tensor  # [B] bool: |ratio - 1| > clip_range
    approx_kl: torch.Tensor  # scalar: 0.5 mean((logp - old)^2)
    behaviour_ratio: torch.Tensor | None = None  # [B] pi_prox / pi_behaviour before truncation (decoupled PPO only)
    behaviour_capped: torch.Tensor | None = None  # [B] bool: behaviour_ratio > behaviour_weight_cap (truncated)
    deviation: torch.Tensor | None = None  # [B]; None: |ratio - 1|
    # the per-timestep ratio statistics (omniroll/train/ratio_steps.py), for an algorithm whose terms have a ratio:
    steps: torch.Tensor | None = None  # [B] long: each row's denoising step index (None: not reported per step)
    log_ratio: torch.Tensor | None = None  # [B] detached log of `ratio` (None: log(ratio))
    log_prob_diff: torch.Tensor | None = None  # [B] detached logp_theta - logp_anchor (None: log_ratio)
    # [B] detached: what a later pass of these rows and this term reads back as `LossInput.first_pass` (module doc);
    # read by the loop only before the step's first optimizer update
    first_pass: torch.Tensor | None = None

    def __post_init__(self):
        if self.deviation is None:
            object.__setattr__(self, "deviation", (self.ratio - 1.0).abs())
        if self.log_ratio is None and self.ratio is not None:
            object.__setattr__(self, "log_ratio", torch.log(self.ratio))


def gated(kl: Optional[torch.Tensor], gate: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The KL per row under `trainer.kl_gate`: a row outside the gate keeps none (its KL times 0), so `with_kl`'s mean
    is the gated rows' KL over all the rows (each gated row weighs kl_beta, as without the gate). None passes."""
    return kl if kl is None or gate is None else kl * gate.to(kl.dtype)


def with_kl(policy_loss: torch.Tensor, kl: Optional[torch.Tensor], kl_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL tail every algorithm shares: (loss, kl_term) with kl_term = mean(kl) (0 without one) and loss =
    policy_loss + kl_beta * kl_term when there is a KL and kl_beta > 0, else policy_loss."""
    kl_term = kl.mean() if kl is not None else torch.zeros((), dtype=policy_loss.dtype)
    loss = policy_loss + kl_beta * kl_term if kl is not None and kl_beta > 0 else policy_loss
    return loss, kl_term
