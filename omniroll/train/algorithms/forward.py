"""What the forward-process algorithms (DiffusionNFT, AWM) share: their rollout and the noising of its clean latents.

Rollout: the deterministic ODE (noise_level 0), CFG off (the reference's; `algorithm_options.rollout_cfg` keeps the
pipeline's CFG), no log-probs, the final latent returned beside the pixels (`output_type` "both"): the engine records
no trajectory, so a rollout costs only its forwards. Rows: `CleanBatch`. Training: each row is noised afresh at some
of its own sampling timesteps, x_t = (1 - t) x0 + t eps, with eps drawn from (seed, step, epoch, micro-batch, timestep)
only (`term_generator`), so a resumed run is bitwise a straight one. A loss term is one forward: the micro-batch's
rows at `timesteps_per_forward` of their timesteps, stacked (1 by default: one timestep per forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from omniroll.config.algorithms import cfg_free_rollout
from omniroll.sampling.seeds import training_timesteps_seed
from omniroll.train.algorithms.base import Algorithm, Anchors, UpdatePlan, term_generator
from omniroll.train.algorithms.terms import LossInput
from omniroll.train.clean_batch import CleanBatch


def draw_timesteps(sigmas: torch.Tensor, count: int, seed: int, step: int, skip_first: bool) -> torch.Tensor:
    """[B, count] sigmas to train each row at: the first `count` of a random permutation of the row's sampling sigmas
    (sigmas[:, :-1]; without the first, sigma = 1, when `skip_first`), drawn per row from (seed, step)."""
    g = torch.Generator().manual_seed(training_timesteps_seed(seed, step))
    B, T = sigmas.shape[0], sigmas.shape[1] - 1
    lo = 1 if skip_first and T > 1 else 0
    count = max(1, min(int(count), T - lo))
    picks = [lo + torch.randperm(T - lo, generator=g)[:count] for _ in range(B)]
    return torch.stack([sigmas[i, p] for i, p in enumerate(picks)]) if B else torch.empty(0, count)


@dataclass
class NoisedTerm:
    """One loss term's rows (`ForwardProcessAlgorithm.noised`): the micro-batch's rows and advantages, repeated once
    per timestep of the term; t [n b]; eps and x_t = (1 - t) x0 + t eps [n b, ...]; weight: what the term's row mean
    is multiplied by so that every timestep weighs the same (1.0 unless the last term has fewer timesteps); kl_gate
    [n b]: the rows' `trainer.kl_gate` (None: every row's KL counts)."""

    rows: CleanBatch
    adv: torch.Tensor
    t: torch.Tensor
    eps: torch.Tensor
    x_t: torch.Tensor
    weight: float
    kl_gate: Optional[torch.Tensor] = None

    def weighed(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`values` (a term's loss and its metrics) times `weight`: a shorter last term's timesteps weigh what the
        others' do."""
        return values if self.weight == 1.0 else tuple(x * self.weight for x in values)


@dataclass
class TimestepAnchors(Anchors):
    """t_of [B, timesteps]: the sigmas a row trains at (`timesteps_per_forward` of them per loss term)."""

    t_of: Optional[torch.Tensor] = None


class ForwardProcessAlgorithm(Algorithm):
    """NFT and AWM: a clean-latent rollout, and per-row training timesteps drawn in `prepare` (`TimestepAnchors`)."""

    skip_first_timestep = False  # AWM trains after the first sampling timestep (its `discrete_wo_init`)

    def sampling_overrides(self, step: int) -> dict:
        """The ODE without log-probs; where the group shares noise (`algo.tree`, `algo.same_latent`) the config's SDE
        window stays: its steps are where the members draw their own noise (the steps outside it are the ODE's)."""
        algo = self.config.algo
        ode = {} if algo.tree is not None or algo.same_latent else {"noise_level": 0.0}
        return {**ode, "logprobs": False, "output_type": "both", **self.rollout_guidance()}

    def rollout_guidance(self) -> dict:
        """CFG off (1.0) unless `rollout_cfg` keeps the pipeline's: the policy it rolls out and trains."""
        if not cfg_free_rollout(self.tc.algorithm, self.tc.algorithm_options):
            return {}
        return {"true_cfg_scale" if self.adapter.guidance_kind == "distilled" else "guidance_scale": 1.0}

    def rows(self, batch, adapter) -> CleanBatch:
        return CleanBatch.from_batch(batch, adapter)

    def timesteps_per_row(self, rows: CleanBatch) -> int:
        raise NotImplementedError

    def prepare(self, policy, rows: CleanBatch, plan: UpdatePlan) -> TimestepAnchors:
        return TimestepAnchors(t_of=draw_timesteps(rows.sigmas, self.timesteps_per_row(rows), plan.seed, plan.step,
                                                   self.skip_first_timestep))

    def num_terms(self, mb, anchors: TimestepAnchors) -> int:
        """Loss terms per micro-batch: its training timesteps, `timesteps_per_forward` of them per term."""
        return -(-int(anchors.t_of.shape[1]) // self.options.timesteps_per_forward)

    def term_timesteps(self, term: int, anchors: TimestepAnchors) -> range:
        """The training timesteps (columns of `anchors.t_of`) loss term `term` stacks into one forward."""
        k = self.options.timesteps_per_forward
        return range(term * k, min((term + 1) * k, int(anchors.t_of.shape[1])))

    def noised(self, inp: LossInput) -> NoisedTerm:
        """Loss term `inp.term`'s rows: the micro-batch's rows once per timestep of the term, stacked
        (timestep-major). Each timestep's eps comes from its own generator (seed, step, epoch, micro-batch, timestep),
        so the rows are those of one forward per timestep whatever `timesteps_per_forward` is."""
        mb, adv, anchors, plan = inp.mb, inp.adv, inp.anchors, inp.plan
        columns = self.term_timesteps(inp.term, anchors)
        ts, epss, xs = [], [], []
        for j in columns:
            t = anchors.t_of[inp.idx, j].float()
            g = term_generator(plan.seed, plan.step, inp.epoch, inp.chunk, j)
            eps = torch.randn(mb.x0.shape, generator=g).to(mb.x0.device)  # drawn on the CPU: the same on any device
            tv = t.view((-1,) + (1,) * (mb.x0.ndim - 1))
            ts.append(t)
            epss.append(eps)
            xs.append((1 - tv) * mb.x0 + tv * eps)
        n, T = len(columns), int(anchors.t_of.shape[1])
        # the term's mean over its n x b rows stands for n of the T timesteps: weight n T' / T (1 when k divides T)
        weight = n * self.num_terms(mb, anchors) / T
        gate = inp.kl_gate
        if n == 1:
            return NoisedTerm(mb, adv, ts[0], epss[0], xs[0], weight, gate)
        rows = mb.rows(torch.arange(len(mb)).repeat(n))
        return NoisedTerm(rows, adv.repeat(n), torch.cat(ts), torch.cat(epss), torch.cat(xs), weight,
                          None if gate is None else gate.repeat(n))

    def kl_to_base(self, policy, mb: CleanBatch, x_t: torch.Tensor, t: torch.Tensor, v: torch.Tensor):
        """mean((v - v_base)^2) per row (the references' velocity KL), or None when kl_beta is 0."""
        if self.tc.kl_beta <= 0:
            return None
        with torch.no_grad(), policy.reference() as ref:
            v_ref = mb.velocity(ref, x_t, t)
        return ((v - v_ref) ** 2).reshape(len(mb), -1).mean(1)
