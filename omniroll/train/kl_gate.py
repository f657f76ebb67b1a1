"""`kl_gate_rows`: GARDO's gate on the KL term (`trainer.kl_gate`): the KL applies only to the step's samples whose
trained reward is least to be trusted, judged by how far it rates them above where other rewards rate them; the rest
train free of it.

For each of the step's B samples, u = its rank under the trained reward (the weighted total) minus the mean of its
ranks under the `against` reward functions, ranks from 1 (the lowest score) to B (the highest), ties sharing their
mean rank. A large u is a sample the trained reward likes much more than the others do: where a proxy is being
fooled. The gate is the ceil(share x B) samples of largest u, those with u > 0 only (ties at the cut broken by row
order). Each gated row keeps its KL at `trainer.kl_beta`; the others' KL is 0 (`omniroll.train.algorithms.terms.
gated`). GARDO's paper (arXiv 2512.24138) gates about 10 % of the samples by the disagreement with auxiliary reward
models. The `against` functions are usually scored at weight 0 (`reward.functions.<name>.weight: 0`): judged, never
trained.

With `kl_gate.adaptive`, the share moves as GARDO's reference moves it (its `RiskCompensator`; `AdaptiveShare`): the
first step gates `share`; after it, when the mean of the step's non-negative u exceeds every one of the last 20
steps' means, the share grows by 10 %; when it is below all of them, it shrinks by 10 %; it stays within
[`share_min`, `share_max`] (GARDO's 0.02 and 0.2). The step logs it as `kl_gate_target`. (GARDO's diversity-aware
advantages are `trainer.diversity_bonus`: omniroll/train/diversity.py.)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def mean_ranks(x: torch.Tensor) -> torch.Tensor:
    """float64 [B]: each value's rank from 1 (the lowest) to B (the highest), tied values sharing their mean rank."""
    x = x.double().reshape(-1)
    less = (x[None, :] < x[:, None]).sum(1).double()
    equal = (x[None, :] == x[:, None]).sum(1).double()
    return less + (equal + 1) / 2


def disagreement(total: torch.Tensor, against: Sequence[torch.Tensor]) -> torch.Tensor:
    """u, float64 [B]: each row's rank under `total` minus the mean of its ranks under the `against` scores."""
    return mean_ranks(total) - torch.stack([mean_ranks(a) for a in against]).mean(0)


class AdaptiveShare:
    """GARDO's adaptive gate share (module doc): `share` to start, within [lo, hi], moved by `rate` when a step's
    mean non-negative disagreement leaves the range of the last `window` steps'. Its state is saved in checkpoints."""

    def __init__(self, share: float, lo: float, hi: float, rate: float = 0.1, window: int = 20):
        self.share, self.lo, self.hi, self.rate, self.window = float(share), float(lo), float(hi), rate, window
        self.means: list[float] = []  # the last `window` steps' mean non-negative u

    def update(self, u: torch.Tensor) -> float:
        """This step's share, from its disagreements `u` [B]."""
        nonneg = u[u >= 0]
        m = float(nonneg.mean()) if nonneg.numel() else 0.0
        if self.means and m > max(self.means):
            self.share *= 1 + self.rate
        elif self.means and m < min(self.means):
            self.share *= 1 - self.rate
        self.share = min(max(self.share, self.lo), self.hi)
        self.means = (self.means + [m])[-self.window:]
        return self.share

    def state_dict(self) -> dict:
        return {"share": self.share, "means": list(self.means)}

    def load_state_dict(self, state: dict) -> None:
        self.share, self.means = float(state["share"]), [float(m) for m in state["means"]]


def kl_gate_rows(total: torch.Tensor, against: Sequence[torch.Tensor], share: float) -> torch.Tensor:
    """float [B] of 0 / 1: the gated rows (module doc). total: the trained reward per row; against: the other
    functions' scores per row (at least one); share in (0, 1]."""
    if not against:
        raise ValueError("kl_gate: at least one reward function to rank against")
    B = total.numel()
    u = disagreement(total, against)
    order = torch.argsort(-u, stable=True)[:math.ceil(share * B)]
    gate = torch.zeros(B, dtype=torch.float32)
    gate[order] = (u[order] > 0).float()
    return gate


def adaptive_share(config) -> Optional[AdaptiveShare]:
    """The run's `AdaptiveShare` (`trainer.kl_gate.adaptive`), None when the gate is off or its share fixed."""
    gate = config.trainer.kl_gate
    if gate is None or not gate.adaptive:
        return None
    return AdaptiveShare(gate.share, gate.share_min, gate.share_max)


def step_kl_gate(config, batch, total: torch.Tensor,
                 adaptive: Optional[AdaptiveShare] = None) -> Optional[torch.Tensor]:
    """This step's gate (`kl_gate_rows` over the rollout `batch`'s component scores, at the share `adaptive` sets
    when given), or None when `trainer.kl_gate` is off. A row without one of the `against` functions' scores is a
    ValueError naming it."""
    from omniroll.train.advantages import batch_components

    gate_cfg = config.trainer.kl_gate
    if gate_cfg is None:
        return None
    scores = batch_components(batch, list(gate_cfg.against))
    total, against = total.detach().cpu(), [torch.tensor(scores[k], dtype=torch.float64) for k in gate_cfg.against]
    share = adaptive.update(disagreement(total, against)) if adaptive is not None else gate_cfg.share
    return kl_gate_rows(total, against, share)
