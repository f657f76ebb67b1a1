"""DiffusionNFT (arXiv 2509.16117; NVlabs/DiffusionNFT `scripts/train_nft_sd3.py`): reinforcement on the forward
process. No log-probs: positive and negative implicit policies around the sampling policy, trained by flow matching
on the rollout's clean latents.

Three sets of weights: the trained theta, `old` (what the replicas sample with, and the anchor) and the base (adapter
off) for the KL. Advantages: per prompt, the batch's std (`global_std`, the reference's), clipped at adv_clip_max (5),
mapped to an optimality probability r = clamp(A / adv_clip_max / 2 + 0.5, 0, 1). Per row and training timestep t (a
random int(T * timestep_fraction) of its T sampling timesteps, fresh eps each):

    x_t   = (1 - t) x0 + t eps
    v_pos = beta v + (1 - beta) v_old ;  v_neg = (1 + beta) v_old - beta v
    L_pos = mean((x_t - t v_pos - x0)^2) / w_pos,  w_pos = max(mean|x_t - t v_pos - x0|, adaptive_weight_min) (no grad)
    loss  = mean_rows((r L_pos + (1 - r) L_neg) / beta * adv_clip_max) + kl_beta mean((v - v_base)^2)

After each step: old <- d old + (1 - d) theta, d from `decay_type` (`old_decay`). At theta = old the two implicit
policies coincide and the gradient with respect to v is advantage-signed flow matching,
2 adv_clip_max (2r - 1) t^2 (v_old - u) / (w D B) (u = eps - x0; D elements per row, B rows); with r = 0.5 it is
exactly zero. Exactness: `ratio_max_abs_dev` reports max |v_theta - v_old| before the step's first update (0.0 when
old == theta: the first step, `decay_type` 0); the rollout's x0 is the ODE's final latent under `old` bitwise (the
replicas hold `old`'s weights, checked by version as for every algorithm). While old == theta bitwise and no optimizer
step has been taken, v_old is v itself (one forward per term instead of two), except for the first term of the
first micro-batch, which runs the old weights' forward so that the 0.0 is measured.

Scaled here: the reference samples with a 10-step second-order DPM solver (DPM-Solver++(2M)); the rollout samples with
the pipeline's deterministic solver at its steps (`pipeline.solver`: the Euler ODE by default, `dpmpp_2m` the
reference's, among the engine's solvers: docs/concepts.md).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from omniroll.train.algorithms.base import UpdatePlan
from omniroll.train.algorithms.forward import ForwardProcessAlgorithm, TimestepAnchors
from omniroll.train.algorithms.terms import LossInput, LossTerms, gated, with_kl
from omniroll.train.clean_batch import CleanBatch


def old_decay(step: int, decay_type: int) -> float:
    """The reference's `return_decay`: 0 -> 0 (old = theta); 1 -> min(0.001 step, 0.5); 2 -> 0 before step 75, then
    min(0.0075 (step - 75), 0.999)."""
    if decay_type == 0:
        return 0.0
    if decay_type == 1:
        return min(0.001 * step, 0.5)
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clamp(A, +-adv_clip_max) / adv_clip_max / 2 + 0.5, 0, 1)."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2 + 0.5).clamp(0.0, 1.0)


def nft_policy_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
                    r: torch.Tensor, beta: float, adv_clip_max: float, weight_min: float) -> torch.Tensor:
    """The NFT objective of one (micro-batch, timestep) (module doc), mean over rows."""
    B = v.shape[0]
    tv = t.view((-1,) + (1,) * (v.ndim - 1)).to(v.dtype)
    x0_pos = x_t - tv * (beta * v + (1 - beta) * v_old)
    x0_neg = x_t - tv * ((1 + beta) * v_old - beta * v)
    with torch.no_grad():
        w_pos = (x0_pos - x0).double().abs().reshape(B, -1).mean(1).clamp(min=weight_min)
        w_neg = (x0_neg - x0).double().abs().reshape(B, -1).mean(1).clamp(min=weight_min)
    l_pos = ((x0_pos - x0) ** 2).reshape(B, -1).mean(1) / w_pos.to(v.dtype)
    l_neg = ((x0_neg - x0) ** 2).reshape(B, -1).mean(1) / w_neg.to(v.dtype)
    r = r.to(v.dtype)
    return torch.mean((r * l_pos + (1 - r) * l_neg) / beta * adv_clip_max)


class NFT(ForwardProcessAlgorithm):
    name = "nft"

    def __init__(self, config, adapter):
        super().__init__(config, adapter)
        self.old: list[torch.Tensor] | None = None  # the sampling weights (a copy of the trained ones at the start)
        self.old_is_theta = True  # old equals the trained weights bitwise (the start; after a step with d = 0)

    def timesteps_per_row(self, rows: CleanBatch) -> int:
        return int(rows.num_steps * self.options.timestep_fraction)

    def prepare(self, policy, rows: CleanBatch, plan: UpdatePlan) -> TimestepAnchors:
        self._ensure_old(policy)  # old starts as a copy of the weights the first rollout sampled with
        return super().prepare(policy, rows, plan)

    # ------------------------------------------------------------------ the old weights
    def _ensure_old(self, policy) -> None:
        if self.old is None:
            self.old = [p.detach().clone() for p in policy.parameters()]

    @contextlib.contextmanager
    def sampling_weights(self, policy) -> Iterator[None]:
        """The policy holds `old` inside the block (exact copies), its trained weights after."""
        self._ensure_old(policy)
        params = policy.parameters()
        live = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, o in zip(params, self.old):
                p.copy_(o)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(params, live):
                    p.copy_(t)

    def after_update(self, policy, step: int) -> dict:
        self._ensure_old(policy)
        d = old_decay(step, self.options.decay_type)
        with torch.no_grad():
            for o, p in zip(self.old, policy.parameters()):
                o.copy_(o * d + p.detach().to(o.device) * (1 - d))
        self.old_is_theta = d == 0.0  # o * 0 + p * 1 is p exactly
        return {"old_decay": d}

    # ------------------------------------------------------------------ the loss
    def loss(self, inp: LossInput) -> LossTerms:
        o, tc, policy = self.options, self.tc, inp.policy
        n = self.noised(inp)  # the term's rows: one forward
        mb, adv, t, x_t = n.rows, n.adv, n.t, n.x_t
        if self.old_is_theta and inp.first_update and (inp.chunk, inp.term) != (0, 0):
            v = mb.velocity(policy.adapter, x_t, t)
            v_old = v.detach()  # old == theta and no optimizer step yet: the same forward, bitwise (the first term
        else:                   # of the first micro-batch still runs it, so ratio_max_abs_dev checks that)
            with torch.no_grad(), self.sampling_weights(policy):  # before v: it swaps the weights in place
                v_old = mb.velocity(policy.adapter, x_t, t)
            v = mb.velocity(policy.adapter, x_t, t)
        policy_loss = nft_policy_loss(v, v_old, x_t, mb.x0, t, optimality_probability(adv, tc.adv_clip_max), o.beta,
                                      tc.adv_clip_max, o.adaptive_weight_min)
        kl = gated(self.kl_to_base(policy, mb, x_t, t, v), n.kl_gate)
        loss, kl_term = with_kl(policy_loss, kl, tc.kl_beta)
        loss, policy_loss, kl_term = n.weighed(loss, policy_loss, kl_term)
        dev = (v.detach() - v_old).abs().reshape(len(mb), -1).amax(1)
        return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=None,
                         clipped=torch.zeros(len(mb), dtype=torch.bool), approx_kl=torch.zeros(()), deviation=dev)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return ({"old": [t.cpu().clone() for t in self.old], "old_is_theta": self.old_is_theta}
                if self.old is not None else {})

    def load_state_dict(self, state: dict) -> None:
        if state.get("old") is not None:
            self.old = [t.to(self.adapter.device, copy=True) for t in state["old"]]  # on the policy's device
        self.old_is_theta = bool(state.get("old_is_theta", False))
