"""Flow-GRPO (arXiv 2505.05470; yifan123/flow_grpo): PPO-clip on the recorded SDE window's exact log-probs.

Rollout: the SDE window's latents and log-probs (`algo.*`: sde, cps or dance_sde steps; `trainer.window_schedule`
slides the window as MixGRPO does). Advantages: per prompt group, the group's std (or the batch's, `global_std`),
clipped. Loss per window step: mean(max(-A r, -A clip(r, 1 +- eps))) + kl_beta KL(pi || base), with r = pi_theta /
pi_old the ratio of Flow-GRPO's mean log-probs; with `max_staleness` >= 1 the decoupled PPO of
omniroll/train/algorithms/ppo.py (AReaL), anchored at the step's proximal weights and weighted by pi_prox /
pi_behaviour. Exact: with the rollout's weights the recompute returns the rollout's log-probs bitwise, so every
ratio is 1.0 before the step's first optimizer update (`ratio_max_abs_dev == 0.0`).

DanceGRPO and GRPO-Guard reuse this rollout and its anchors (dance_grpo.py, grpo_guard.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from omniroll.sampling.window import window_for_step
from omniroll.train.algorithms.base import Algorithm, Anchors, UpdatePlan
from omniroll.train.algorithms.ppo import decoupled_ppo_loss, density_log_ratio_scale, kl_to_reference, ppo_clip_loss
from omniroll.train.algorithms.terms import LossInput, LossTerms, gated
from omniroll.train.recompute import recompute_log_probs
from omniroll.train.trajectory_batch import TrajectoryBatch
from omniroll.train.behaviour_log_probs import behaviour_and_replay

#: the fixed subset (first rows) whose recorded log-probs are replayed every step
REPLAY_ROWS = 2


@dataclass
class WindowAnchors(Anchors):
    """Flow-GRPO's anchors (and DanceGRPO's). steps_of [B, terms]: the window step each loss term of a row trains;
    behaviour [B, W]: the behaviour log-probs recomputed under the versions that ran them (None: the recorded ones
    are the anchor); prox [B, W]: the decoupled loss's proximal log-probs (None: not decoupled; NaN for the rows the
    step's first pass scores before its first optimizer update: their anchor is that pass's own log-prob, which the
    update loop hands back to their later passes as `LossInput.first_pass`)."""

    steps_of: Optional[torch.Tensor] = None
    behaviour: Optional[torch.Tensor] = None
    prox: Optional[torch.Tensor] = None


class FlowGRPO(Algorithm):
    name = "flow_grpo"

    # ------------------------------------------------------------------ the rollout
    def sampling_overrides(self, step: int) -> dict:
        a, tc = self.config.algo, self.tc
        window = window_for_step(tc.window_schedule, step, self.config.pipeline.num_inference_steps,
                                 a.sde_window_size, a.sde_window_range, tc.seed, tc.window_advance_every)
        if window is None:
            return {}
        return {"sde_window_size": window[1] - window[0], "sde_window_range": window}

    def rows(self, batch, adapter) -> TrajectoryBatch:
        return TrajectoryBatch.from_batch(batch)

    # ------------------------------------------------------------------ the anchors
    def off_policy(self) -> bool:
        """Whether this run's behaviour log-probs are an anchor of their own: its rows may have been sampled by older
        weights (`max_staleness` >= 1) or their log-probs are recomputed (`old_log_prob: recompute`). Then a
        decoupled algorithm (`AlgorithmSpec.decoupled`) trains the decoupled PPO against proximal anchors; GRPO-Guard
        anchors its ratio at the behaviour."""
        return self.tc.max_staleness > 0 or self.tc.old_log_prob == "recompute"

    def prepare(self, policy, rows: TrajectoryBatch, plan: UpdatePlan) -> WindowAnchors:
        """The behaviour log-probs (recorded, or recomputed under the versions that ran them), the decoupled loss's
        proximal anchors for rows scored after the first update, and which window step each term trains."""
        tc = self.tc
        behaviour, replay_dev = behaviour_and_replay(
            plan.store, rows, plan.versions, old_log_prob=tc.old_log_prob, decoupled=self.off_policy(),
            micro_batch_size=plan.micro_batch_size, replay_rows=REPLAY_ROWS)
        prox = None
        if behaviour is not None and self.spec.decoupled:
            prox = self._prox_anchors(policy, rows, plan)
        return WindowAnchors(metrics={"behaviour_replay_max_abs_dev": replay_dev},
                             steps_of=self.train_steps(rows, plan), behaviour=behaviour, prox=prox)

    def rows_before_first_update(self, rows, plan: UpdatePlan) -> set:
        """The rows of epoch 0 scored before its first optimizer update (its first accumulation group)."""
        ep = self.micro_batches(rows, plan, 0)
        return {int(i) for c in ep.groups[0] for i in ep.chunks[c]} if ep.groups else set()

    def train_steps(self, rows: TrajectoryBatch, plan: UpdatePlan) -> torch.Tensor:
        """[B, terms]: the window step each loss term of a row trains (Flow-GRPO: every recorded step, in order)."""
        return torch.arange(rows.num_steps).expand(len(rows), rows.num_steps)

    @torch.no_grad()
    def _prox_anchors(self, policy, rows: TrajectoryBatch, plan: UpdatePlan) -> torch.Tensor:
        """pi_prox of every row and step: rows seen after the first update, and the check rows (whose anchor is a
        true no-grad recompute, so ratio_max_abs_dev measures it), now; the others in the first pass (NaN here)."""
        B, W = len(rows), rows.num_steps
        prox = torch.full((B, W), float("nan"), device=rows.log_probs.device)
        first = self.rows_before_first_update(rows, plan)
        need = sorted((set(range(B)) - first) | set(range(min(REPLAY_ROWS, B))))
        for chunk in torch.tensor(need, dtype=torch.long).split(plan.micro_batch_size) if need else ():
            for k in range(W):
                prox[chunk, k] = recompute_log_probs(policy.adapter, rows.rows(chunk), k).log_prob.float()
        return prox

    # ------------------------------------------------------------------ the loss
    def num_terms(self, mb, anchors: WindowAnchors) -> int:
        return int(anchors.steps_of.shape[1])

    def kl(self, policy, view: TrajectoryBatch, out):
        """flow_grpo's KL to the base model for the view's step (None when kl_beta is 0)."""
        if self.tc.kl_beta <= 0:
            return None
        with torch.no_grad(), policy.reference() as ref:
            ref_out = recompute_log_probs(ref, view, 0)
        return kl_to_reference(out.mean, ref_out.mean, out.std, view.sigmas_next[:, 0] - view.sigmas[:, 0],
                               view.sde_type)

    def loss(self, inp: LossInput) -> LossTerms:
        anchors, idx, adv, tc = inp.anchors, inp.idx, inp.adv, self.tc
        steps = anchors.steps_of[idx, inp.term]
        view = inp.mb.at_steps(steps)
        out = recompute_log_probs(inp.policy.adapter, view, 0)
        kl = gated(self.kl(inp.policy, view, out), inp.kl_gate)
        first_pass = None
        if anchors.prox is None:
            old = view.log_probs[:, 0] if anchors.behaviour is None else anchors.behaviour[idx, steps]
            terms = ppo_clip_loss(out.log_prob, old, adv, tc.clip_range, kl, tc.kl_beta)
        else:
            p = anchors.prox[idx, steps]
            # the rows scored before the step's first update (NaN) are anchored at that pass's own log-prob
            scored = out.log_prob.detach().float() if inp.first_update else inp.first_pass
            if scored is not None:
                p = torch.where(torch.isnan(p), scored, p)
            first_pass = p if inp.first_update else None
            terms = decoupled_ppo_loss(out.log_prob, p, anchors.behaviour[idx, steps], adv, tc.clip_range,
                                       tc.behaviour_weight_cap, kl, tc.kl_beta,
                                       density_log_ratio_scale(out.std, view.sde_type, view.latents[0, 0].numel()))
        # the per-timestep statistics (omniroll/train/ratio_steps.py)
        return replace(terms, steps=inp.mb.denoising_steps(steps), first_pass=first_pass)
