"""One fp32 transition of the reverse flow-matching process, with its log-probability.

The same function serves the rollout (draw a sample, record its log-prob) and the trainer's recompute (pass
`prev_sample`: score that sample instead of drawing one), so the two can never drift apart.

Notation: x = latents at sigma, v = velocity (after CFG), dt = sigma_next - sigma (< 0), eta = noise_level.

`sde` (Flow-GRPO):
    std_t = eta * sqrt(sigma / (1 - sigma~)),  sigma~ = sigma_max where sigma == 1, else sigma
    mean  = x * (1 + std_t^2 * dt / (2 sigma)) + v * (1 + std_t^2 * (1 - sigma) / (2 sigma)) * dt
    s     = std_t * sqrt(-dt);   x' = mean + s * eps
    log p = -(x' - mean)^2 / (2 s^2) - log s - log sqrt(2 pi)               (per element)

`cps` (coefficients-preserving sampling):
    s     = sigma_next * sin(eta * pi / 2)
    mean  = (1 - sigma_next) * (x - sigma v) + sqrt(sigma_next^2 - s^2) * (x + (1 - sigma) v)
    x' = mean + s * eps
    log p = -(x' - mean)^2      (as published: no 1/(2 s^2) scaling and no normaliser, so it is NOT a density;
                                 ratios exp(logp - logp_old) are still exact for the same s)

`dance_sde` (DanceGRPO, as VeRL-Omni defines it):
    x0    = x - sigma v;   score = -(x - (1 - sigma) x0) / sigma^2
    mean  = x + dt * v - 0.5 * eta^2 * score * dt
    s     = eta * sqrt(sigma - sigma_next);   x' = mean + s * eps
    log p = -(x' - mean)^2 / (2 s^2) - log s - log sqrt(2 pi)               (per element)

`ode`, or eta == 0: the Euler step x' = x + dt * v, identical to diffusers' FlowMatchEulerDiscreteScheduler.step
(the `euler` solver of sampling/solvers.py; the engine takes the deterministic steps of another solver there).
Deterministic rows (s == 0: ode, eta == 0, or the last CPS step where sigma_next == 0) move to their mean. Their log p
is 0 at the mean; a `cps` row scored away from its mean (trainer recompute with other weights) reports
-(x' - mean)^2 like every other CPS step (what flow_grpo and VeRL-Omni return), never a constant 0. Gaussian rows
(`sde`, `dance_sde`) have no density at s == 0 and report 0.

The kinds are a table, `SDE_KINDS`: each kind's moments (mean, std) and how its log-prob is scored; every row starts
from the Euler step and a stochastic kind's rows take their own moments.

Reduction: per row over all non-batch dims, `mean` (Flow-GRPO's convention, the default) or `sum`, each row reduced
on its own so its log-prob is bitwise the same in any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence, Union

import torch

ScalarOrRows = Union[float, torch.Tensor]
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStepOutput:
    prev_sample: torch.Tensor  # [B, ...] fp32
    log_prob: torch.Tensor  # [B] fp32
    mean: torch.Tensor  # [B, ...] fp32
    std: torch.Tensor  # [B] fp32, std of the transition (s above)


@dataclass(frozen=True)
class StepRows:
    """What a kind's moments read: latents x and velocities v [B, ...], and per-row fp32 [B] sigma (`s_t`),
    sigma_next (`s_n`), dt = s_n - s_t, eta, and sigma_max (None when the caller gave none); `view` broadcasts a [B]
    tensor over a row's elements."""

    x: torch.Tensor
    v: torch.Tensor
    s_t: torch.Tensor
    s_n: torch.Tensor
    dt: torch.Tensor
    eta: torch.Tensor
    sigma_max: Optional[ScalarOrRows]
    view: tuple[int, ...]


#: (rows, is_kind [B] bool) -> (mean [B, ...], std [B]); only the rows where is_kind holds are read
Moments = Callable[[StepRows, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _flow_sde_moments(r: StepRows, is_sde: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO's `sde` (module docstring); sigma_max stands in for sigma == 1 (required there)."""
    B, view = r.x.shape[0], r.view
    if r.sigma_max is not None:
        denom_sigma = torch.where(r.s_t >= 1.0, _rows(r.sigma_max, B, "sigma_max").to(r.x.device), r.s_t)
    elif bool(((r.s_t >= 1.0) & is_sde).any()):
        raise ValueError("sigma_max (the schedule's second sigma) is required for 'sde' rows at sigma == 1")
    else:
        denom_sigma = r.s_t
    safe_s = torch.where(is_sde, r.s_t, torch.ones_like(r.s_t))
    std_t = torch.where(is_sde, r.eta * torch.sqrt(safe_s / (1 - torch.where(is_sde, denom_sigma, 0.5 * r.s_t))), 0.0)
    a = (1 + std_t**2 * r.dt / (2 * safe_s)).view(view)
    b = ((1 + std_t**2 * (1 - r.s_t) / (2 * safe_s)) * r.dt).view(view)
    return r.x * a + r.v * b, std_t * torch.sqrt(torch.clamp(-r.dt, min=0.0))


def _cps_moments(r: StepRows, is_cps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients-preserving sampling (`cps`, module docstring)."""
    view = r.view
    s_cps = r.s_n * torch.sin(r.eta * math.pi / 2)
    x0 = r.x - r.s_t.view(view) * r.v
    x1 = r.x + (1 - r.s_t).view(view) * r.v
    mean = (1 - r.s_n).view(view) * x0 + torch.sqrt(torch.clamp(r.s_n**2 - s_cps**2, min=0.0)).view(view) * x1
    return mean, s_cps


def _dance_sde_moments(r: StepRows, is_dance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DanceGRPO's `dance_sde` (module docstring)."""
    view = r.view
    safe_s = torch.where(is_dance, r.s_t, torch.ones_like(r.s_t)).view(view)
    x0 = r.x - safe_s * r.v
    score = -(r.x - (1 - safe_s) * x0) / safe_s**2
    mean = r.x + r.dt.view(view) * r.v - 0.5 * (r.eta**2).view(view) * score * r.dt.view(view)
    return mean, r.eta * torch.sqrt(torch.clamp(-r.dt, min=0.0))


@dataclass(frozen=True)
class SDEKind:
    """One `sde_type`: its integer code (what `sde_step` also accepts), its step's moments (None: the Euler step,
    which every row starts from), and how its log-prob is scored: "gaussian" (the density, 0 where std == 0) or
    "squared_error" (-(x' - mean)^2, also where std == 0)."""

    code: int
    moments: Optional[Moments]
    log_prob: Literal["gaussian", "squared_error"]


#: sde_type name -> its kind. A new kind is a moments function and a row here (and its name in engine.params.SdeType).
SDE_KINDS: dict[str, SDEKind] = {
    "sde": SDEKind(1, _flow_sde_moments, "gaussian"),
    "cps": SDEKind(2, _cps_moments, "squared_error"),
    "dance_sde": SDEKind(3, _dance_sde_moments, "gaussian"),
    "ode": SDEKind(0, None, "gaussian"),
}
#: sde_type name -> the integer code `sde_step` also accepts (a tensor of codes keeps a device caller sync-free).
SDE_CODES = {name: kind.code for name, kind in SDE_KINDS.items()}
SDE_TYPES = tuple(SDE_CODES)
_SQUARED_ERROR_CODES = tuple(kind.code for kind in SDE_KINDS.values() if kind.log_prob == "squared_error")


def _rows(value: ScalarOrRows, batch: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.ndim == 0:
        return t.expand(batch).clone()
    if t.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or a tensor of shape [{batch}], got shape {tuple(t.shape)}")
    return t.float()


def _codes(sde_type: Union[str, Sequence[str], torch.Tensor], batch: int) -> torch.Tensor:
    if isinstance(sde_type, torch.Tensor):
        if sde_type.shape != (batch,):
            raise ValueError(f"sde_type codes must have shape [{batch}], got {tuple(sde_type.shape)}")
        return sde_type.long()
    types = [sde_type] * batch if isinstance(sde_type, str) else list(sde_type)
    if len(types) != batch:
        raise ValueError(f"sde_type must be one string or a list of {batch}, got {len(types)}")
    bad = [t for t in types if t not in SDE_CODES]
    if bad:
        raise ValueError(f"sde_type must be one of {sorted(SDE_CODES)}, got {bad[0]!r}")
    return torch.tensor([SDE_CODES[t] for t in types])


def _draw_noise(shape, generator, device) -> torch.Tensor:
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    gens = list(generator)
    if len(gens) != shape[0]:
        raise ValueError(f"generator list must have one generator per row ({shape[0]}), got {len(gens)}")
    return torch.stack([torch.randn(shape[1:], generator=g, device=device, dtype=torch.float32) for g in gens])


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: ScalarOrRows,
    sigma_next: ScalarOrRows,
    noise_level: ScalarOrRows,
    sde_type: Union[str, Sequence[str]] = "sde",
    noise: Optional[torch.Tensor] = None,
    generator=None,
    prev_sample: Optional[torch.Tensor] = None,
    reduce: str = "mean",
    sigma_max: Optional[ScalarOrRows] = None,
) -> SDEStepOutput:
    """Take one step from `sigma` to `sigma_next` for every row (see the module docstring for the formulas).

    sigma, sigma_next, noise_level, sigma_max: scalars or per-row [B] tensors. sde_type: one name or one per row.
    noise: eps [B, ...] to use; else drawn from `generator` (one torch.Generator, or a list with one per row).
    prev_sample: score this sample instead of drawing one (the trainer's recompute path).
    sigma_max: the schedule's second sigma, used by `sde` in place of sigma where sigma == 1 (required then).
    """
    # 1. Check the arguments and read every per-row parameter (sigma, sigma_next, eta, SDE type) as a [B] tensor.
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    if latents.shape != velocity.shape:
        raise ValueError(f"latents {tuple(latents.shape)} and velocity {tuple(velocity.shape)} must match")
    x = latents.float()
    v = velocity.float()
    B = x.shape[0]
    device = x.device
    view = (B,) + (1,) * (x.ndim - 1)
    s_t = _rows(sigma, B, "sigma").to(device)
    s_n = _rows(sigma_next, B, "sigma_next").to(device)
    eta = _rows(noise_level, B, "noise_level").to(device)
    code = _codes(sde_type, B).to(device)
    # On an accelerator a data-dependent branch would stall the host until the device catches up, so there every
    # branch is computed and selected per row (the same values row by row) and the caller owns the eta >= 0 check.
    on_host = device.type == "cpu"
    if on_host and (eta < 0).any():
        raise ValueError("noise_level must be >= 0")
    # scored by their kind's squared error even where deterministic (see the module docstring)
    squared_error_rows = torch.zeros_like(code, dtype=torch.bool)
    for squared_error_code in _SQUARED_ERROR_CODES:
        squared_error_rows |= code == squared_error_code
    code = torch.where(eta == 0, torch.zeros_like(code), code)
    dt = s_n - s_t

    # 2. The ODE (Euler) step for every row; each stochastic kind's rows overwrite their mean and std (`SDE_KINDS`).
    rows = StepRows(x=x, v=v, s_t=s_t, s_n=s_n, dt=dt, eta=eta, sigma_max=sigma_max, view=view)
    mean = x + dt.view(view) * v
    std = torch.zeros(B, dtype=torch.float32, device=device)
    for kind in SDE_KINDS.values():
        if kind.moments is None:
            continue
        is_kind = code == kind.code
        if not on_host or is_kind.any():
            kind_mean, kind_std = kind.moments(rows, is_kind)
            mean = torch.where(is_kind.view(view), kind_mean, mean)
            std = torch.where(is_kind, kind_std, std)

    # 3. The sample: drawn from the Gaussian (rollout), or the one given (the trainer's recompute).
    if prev_sample is None:
        if noise is None:
            noise = _draw_noise(tuple(x.shape), generator, device)
        elif noise.shape != x.shape:
            raise ValueError(f"noise {tuple(noise.shape)} must match latents {tuple(x.shape)}")
        prev = mean + std.view(view) * noise.float()
    else:
        if prev_sample.shape != x.shape:
            raise ValueError(f"prev_sample {tuple(prev_sample.shape)} must match latents {tuple(x.shape)}")
        prev = prev_sample.float()

    # 4. Its log-prob under this step's Gaussian (CPS: minus the squared error), one reduction per row.
    stochastic = std > 0
    safe_std = torch.where(stochastic, std, torch.ones_like(std)).view(view)
    sq = (prev.detach() - mean) ** 2
    gauss = -sq / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    per_elem = torch.where(stochastic.view(view), gauss, torch.zeros_like(gauss))
    per_elem = torch.where(squared_error_rows.view(view), -sq, per_elem)
    # One reduction per row: a reduction over [B, ...] changes its summation order with B (measured: ~1e-9 on a
    # mean), which would make a row's log-prob depend on its batch mates and break bitwise recompute.
    rows = per_elem.reshape(B, -1).unbind(0)
    log_prob = torch.stack([r.mean() if reduce == "mean" else r.sum() for r in rows])
    return SDEStepOutput(prev_sample=prev, log_prob=log_prob, mean=mean, std=std)
