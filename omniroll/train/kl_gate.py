"""`kl_gate_rows`: GARDO's gate on the KL term (`trainer.kl_gate`): the KL applies only to the step's samples whose
trained reward is least to be trusted, judged by how far it rates them above where other rewards rate them; the rest
train free of it.

For each of the step's B samples, u = its rank under the trained reward (the weighted total) minus the mean of its
ranks under the `against` reward functions, ranks from 1 (the lowest score) to B (the highest), ties sharing their
mean rank. A large u is a sample the trained reward likes much more than the others do: where a proxy is being
fooled. The gate is the ceil(share x B) samples of largest u, those with u > 0 only (ties at the cut broken by row
order). Each gated row keeps its KL at `trainer.kl_beta`; the others' KL is 0 (`omniroll.train.algorithms.terms.
gated`). GARDO's paper (arXiv 2512.24138) gates about 10 % of the samples by the disagreement with auxiliary reward
models; its adaptive share and its diversity bonus are not here. The `against` functions are usually scored at weight
0 (`reward.functions.<name>.weight: 0`): judged, never trained.
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


def kl_gate_rows(total: torch.Tensor, against: Sequence[torch.Tensor], share: float) -> torch.Tensor:
    """float [B] of 0 / 1: the gated rows (module doc). total: the trained reward per row; against: the other
    functions' scores per row (at least one); share in (0, 1]."""
    if not against:
        raise ValueError("kl_gate: at least one reward function to rank against")
    B = total.numel()
    u = mean_ranks(total) - torch.stack([mean_ranks(a) for a in against]).mean(0)
    order = torch.argsort(-u, stable=True)[:math.ceil(share * B)]
    gate = torch.zeros(B, dtype=torch.float32)
    gate[order] = (u[order] > 0).float()
    return gate


def step_kl_gate(config, batch, total: torch.Tensor) -> Optional[torch.Tensor]:
    """This step's gate (`kl_gate_rows` over the rollout `batch`'s component scores), or None when `trainer.kl_gate`
    is off. A row without one of the `against` functions' scores is a ValueError naming it."""
    from omniroll.train.advantages import batch_components

    gate_cfg = config.trainer.kl_gate
    if gate_cfg is None:
        return None
    scores = batch_components(batch, list(gate_cfg.against))
    return kl_gate_rows(total.detach().cpu(), [torch.tensor(scores[k], dtype=torch.float64) for k in gate_cfg.against],
                        gate_cfg.share)
