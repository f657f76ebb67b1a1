"""Deterministic solvers: the step a sample takes where it draws no noise, and the history a multistep one keeps.

A request's `solver` (`SamplingParams.solver`, config key `pipeline.solver`) takes its deterministic steps: every step
of an ODE rollout (noise_level 0 or sde_type ode), and the steps before and after the SDE window of a stochastic one.
The window's steps are always `sde_step`'s (sampling/sde.py): they draw noise and record log-probs, and the trainer's
recompute scores them with that same function, whatever the solver.

`euler` (the default): x' = x + (sigma_next - sigma) v, diffusers' FlowMatchEulerDiscreteScheduler.step. It is
`sde_step` at noise level 0, and the engine takes it there, as it always has. It keeps no history.

`dpmpp_2m`: DPM-Solver++(2M) (Lu et al. 2022, arXiv:2211.01095), the data-prediction multistep solver, for flow
matching, computed as diffusers' DPMSolverMultistepScheduler computes it (algorithm_type "dpmsolver++", solver_order 2,
solver_type "midpoint", prediction_type "flow_prediction", use_flow_sigmas, final_sigmas_type "zero",
lower_order_final) on the request's own sigmas, with the same fp32 operations in the same order:

    x0 = x - sigma v;   alpha = 1 - sigma;   lambda = log(alpha) - log(sigma);   h = lambda_next - lambda
    first order:   x' = (sigma_next / sigma) x - alpha_next (e^-h - 1) x0
    second order:  x' = first order - 0.5 alpha_next (e^-h - 1) (x0 - x0_prev) / r,   r = (lambda - lambda_prev) / h

    First order at a sample's first step, at its last (sigma_next = 0 gives x' = x0: diffusers' lower_order_final),
    and at its first deterministic step after its SDE window (the window's noise left the trajectory the history
    describes, so the history restarts); second order elsewhere, with the previous step's x0.

State: what a multistep solver carries from one step to the next is a `SolverState` on the request
(`RequestState.solver_state`); the engine's group prefix sharing copies it with the latent when a sample forks. Per
row: a request's coefficients are computed once, from its own sigmas (`Solver.plan`), and a step is elementwise, so a
row's result never depends on its batch mates.

A new solver is a plan function, a step function and a row in `SOLVERS` (and its name in `engine.params.SolverName`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class SolverState:
    """What a multistep solver carries from one deterministic step of a sample to its next: the data prediction x0
    of the step before (None: no history; a step that needs one is refused)."""

    prev_x0: Optional[torch.Tensor] = None

    def copy(self) -> "SolverState":
        return SolverState(None if self.prev_x0 is None else self.prev_x0.clone())


@dataclass(frozen=True)
class SolverPlan:
    """A sample's solver steps, computed once from its sigmas: `coefficients` [T, K] fp32 on the host (row k: what
    step k multiplies, in its solver's layout), `uses_history` [T]: step k reads the previous step's SolverState."""

    coefficients: torch.Tensor
    uses_history: tuple[bool, ...]


#: (sigmas [T + 1] fp32, deterministic [T]: the steps the solver takes) -> the sample's plan
PlanFn = Callable[[torch.Tensor, Sequence[bool]], SolverPlan]
#: (x [B, ...], v [B, ...], sigma [B], coefficients [B, K], history [B]) -> (x' [B, ...], the rows' new states)
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Sequence[SolverState]],
                  tuple[torch.Tensor, list[SolverState]]]


@dataclass(frozen=True)
class Solver:
    """One `solver` name. `plan` and `step` are None for `euler`: its step is `sde_step` at noise level 0."""

    plan: Optional[PlanFn]
    step: Optional[StepFn]


def _lambda(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, lambda) of a 0-d fp32 sigma, as diffusers computes them for flow sigmas."""
    alpha = 1 - sigma
    return alpha, torch.log(alpha) - torch.log(sigma)


def dpmpp_2m_plan(sigmas: torch.Tensor, deterministic: Sequence[bool]) -> SolverPlan:
    """Per step k: [sigma_next / sigma, alpha_next (e^-h - 1), 0.5 alpha_next (e^-h - 1), 1 / r, second order (1.0 or
    0.0)], each a 0-d fp32 operation of diffusers' (the last two 0 at a first-order step)."""
    T = len(deterministic)
    if sigmas.shape != (T + 1,) or sigmas.dtype != torch.float32:
        raise ValueError(f"sigmas must be fp32 of shape [{T + 1}] (one more than the steps), got {sigmas.dtype} "
                         f"{tuple(sigmas.shape)}")
    rows, history = [], []
    for k in range(T):
        second = 0 < k < T - 1 and deterministic[k] and deterministic[k - 1]
        sigma_t, sigma_s0 = sigmas[k + 1], sigmas[k]
        alpha_t, lambda_t = _lambda(sigma_t)
        _, lambda_s0 = _lambda(sigma_s0)
        h = lambda_t - lambda_s0
        c_x0 = alpha_t * (torch.exp(-h) - 1.0)
        c_half, inv_r = torch.zeros(()), torch.zeros(())
        if second:
            _, lambda_s1 = _lambda(sigmas[k - 1])
            r0 = (lambda_s0 - lambda_s1) / h
            c_half, inv_r = 0.5 * c_x0, 1.0 / r0
        rows.append(torch.stack([sigma_t / sigma_s0, c_x0, c_half, inv_r, torch.tensor(float(second))]))
        history.append(second)
    return SolverPlan(torch.stack(rows).float(), tuple(history))


def dpmpp_2m_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, coefficients: torch.Tensor,
                  history: Sequence[SolverState]) -> tuple[torch.Tensor, list[SolverState]]:
    """One DPM-Solver++(2M) step for every row (its order is its plan's): diffusers' expressions, elementwise."""
    view = (x.shape[0],) + (1,) * (x.ndim - 1)
    c = [coefficients[:, j].reshape(view) for j in range(5)]
    x0 = x - sigma.reshape(view) * v  # diffusers' convert_model_output for flow_prediction
    first = c[0] * x - c[1] * x0
    prev_x0 = torch.stack([x0[i] if h.prev_x0 is None else h.prev_x0 for i, h in enumerate(history)])
    second = first - c[2] * (c[3] * (x0 - prev_x0))
    x_next = torch.where(c[4] > 0, second, first)
    return x_next, [SolverState(prev_x0=x0[i].clone()) for i in range(x.shape[0])]


#: solver name -> its plan and step. `euler` first: the default.
SOLVERS: dict[str, Solver] = {
    "euler": Solver(plan=None, step=None),
    "dpmpp_2m": Solver(plan=dpmpp_2m_plan, step=dpmpp_2m_step),
}
SOLVER_NAMES = tuple(SOLVERS)
