"""One sample inside the engine, from admission to its last step: `RequestState` (its generator, its latent, its
step, what it has recorded) and the prefix a tree or a shared group hands on (`PrefixState`). How a finished (or
aborted) state becomes a `DiffusionOutput` is `omniroll.engine.output_assembly`.

Everything a step reads or writes lives on the engine's device from admission on (latent, noise, per-step sigmas,
timesteps and noise levels, recorded latents and log-probs), so the step loop never copies between host and
device; host copies of the schedule serve the outputs and the engine's own decisions. An output leaves the device
once, when it is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from omniroll.engine.params import GenerationRequest
from omniroll.models.base import NO_CFG, Conditioning
from omniroll.sampling import draw_sde_window, make_generator
from omniroll.sampling.sde import SDE_CODES
from omniroll.sampling.solvers import SOLVERS, SolverPlan, SolverState


#: callback(output, exception): exactly one of the two is set.
DoneCallback = Callable[[Optional[object], Optional[BaseException]], None]


class RequestState:
    """One sample in flight. Everything random comes from its own generator (on the engine's device), in a fixed
    order: initial latent, window start, then one noise draw per SDE step, so the sample never depends on its batch
    mates. With `latent_seed` the initial latent and the window start come from a generator of that seed instead
    (shared by a group), the window's noise still from the request's own. `cfg_scale` (`NO_CFG`: no unconditional row)
    and `experts` (the denoiser of each step) come from the adapter. A step inside the SDE window is `sde_step`'s; the
    others are its solver's (sampling/solvers.py), whose history between steps is `solver_state`.

    A queued request holds only what admission and scheduling read (its request, schedule, latent shape, rows);
    `start()`, at admission, builds the rest (generator, initial latent, window, device copies), so a long queue costs
    no latent memory. The draws are the same whenever it starts (they come from its own seeds)."""

    def __init__(self, request: GenerationRequest, sigmas: torch.Tensor, latent_shape: tuple[int, ...],
                 on_done: DoneCallback, num_train_timesteps: int = 1000, device: torch.device | str = "cpu",
                 cfg_scale: float | str = "standard"):
        self.request = request
        self.params = p = request.sampling_params
        self.on_done = on_done
        self.submitted_at = time.time()
        self.device = torch.device(device)
        if cfg_scale == "standard":  # what SD3-style CFG does; the engine passes its adapter's answer
            cfg_scale = float(p.guidance_scale) if p.guidance_scale > 1.0 else NO_CFG
        self.cfg_scale = cfg_scale
        self.sigmas = sigmas  # [T + 1] fp32 on the host, ends at 0
        self.timesteps = sigmas[:-1] * num_train_timesteps  # what the denoiser sees (as diffusers computes them)
        self.latent_shape = tuple(latent_shape)
        self.experts: Optional[list[int]] = None  # per step, set by the engine for multi-denoiser families
        self.started = False  # `start()` ran: the fields below hold their values
        self.generator: Optional[torch.Generator] = None  # the window's noise (replaced at each `noise_seeds` step)
        self.noise_segment = -1  # which `noise_seeds` pair the generator is (-1: the request's own seed)
        self.latents: Optional[torch.Tensor] = None
        self.window: Optional[tuple[int, int]] = None
        self.step_index = 0
        self.solver = SOLVERS[p.solver]  # takes the steps outside the SDE window (sampling/solvers.py)
        self.solver_plan: Optional[SolverPlan] = None  # its coefficients per step, set at start (not for euler)
        self.solver_state = SolverState()  # what a multistep solver carries to the next step (a fork copies it)
        self.num_preempted = 0
        self.cond: Optional[Conditioning] = None
        self.uncond: Optional[Conditioning] = None
        # Weight versions (see the module doc for what the output reports): the engine's version when the request
        # was admitted, the version the engine runs its next step with (set by the engine before each step), and the
        # version that ran each step so far (index = step index; a prefix follower copies its leader's).
        self.admitted_version: Optional[int] = None
        self.running_version: Optional[int] = None
        self.step_versions: list[int] = []
        # Recorded over the SDE window (device tensors until the output is built).
        self.rec_latents: list[torch.Tensor] = []
        self.rec_log_probs: list[torch.Tensor] = []
        self.rec_steps: list[int] = []

    def start(self) -> None:
        """At admission: the generator, the initial latent, the SDE window and the device copies of everything a step
        reads (one transfer here, none per step). Idempotent."""
        if self.started:
            return
        p = self.params
        self.generator = make_generator(self.request.seed, self.device)
        prefix_gen = self.generator if p.latent_seed is None else make_generator(p.latent_seed, self.device)
        self.latents = torch.randn(self.latent_shape, generator=prefix_gen, dtype=torch.float32, device=self.device)
        self.window = draw_sde_window(p.num_inference_steps, p.sde_window_size, p.sde_window_range, prefix_gen)
        T = p.num_inference_steps
        stochastic = [self.window[0] <= k < self.window[1] and p.stochastic for k in range(T)]
        self._stochastic = stochastic
        self.dev_sigmas = self.sigmas.to(self.device)
        self.dev_timesteps = self.timesteps.to(self.device)
        self.dev_noise_level = torch.tensor([p.noise_level if s else 0.0 for s in stochastic],
                                            dtype=torch.float32).to(self.device)
        self.dev_sde_code = torch.tensor(SDE_CODES[p.sde_type if p.stochastic else "ode"]).to(self.device)
        self.dev_sigma_max = self.sigma_max.to(self.device)
        self.dev_guidance = torch.tensor(float(p.guidance_scale), dtype=torch.float32).to(self.device)
        if self.solver.plan is not None:
            self.solver_plan = self.solver.plan(self.sigmas, [not s for s in stochastic])
            self.dev_solver_coefficients = self.solver_plan.coefficients.to(self.device)
        self.started = True

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_rows(self) -> int:
        return 1 if self.cfg_scale == NO_CFG else 2

    @property
    def done(self) -> bool:
        return self.step_index >= self.params.num_inference_steps

    @property
    def in_window(self) -> bool:
        return self.window[0] <= self.step_index < self.window[1]

    @property
    def sigma_max(self) -> torch.Tensor:
        """The schedule's second sigma: what the `sde` step uses in place of sigma == 1."""
        return self.sigmas[min(1, len(self.sigmas) - 1)]

    @property
    def expert(self) -> int:
        """The denoiser this request's next step runs on."""
        return 0 if self.experts is None or self.done else self.experts[self.step_index]

    @property
    def batch_key(self) -> tuple:
        """Rows of one forward share frames, resolution, text length and denoiser."""
        return self.params.batch_key() + (self.expert,)

    def step_inputs(self) -> tuple[torch.Tensor, ...]:
        """Device scalars of the current step: (timestep, sigma, sigma_next, noise_level, sde_code)."""
        k = self.step_index
        return (self.dev_timesteps[k], self.dev_sigmas[k], self.dev_sigmas[k + 1], self.dev_noise_level[k],
                self.dev_sde_code)

    @property
    def takes_solver_step(self) -> bool:
        """The current step is a deterministic step of a solver other than euler (`solver_inputs`); every other step
        (in the SDE window, or an Euler step: noise level 0) is `sde_step`'s (`step_inputs`)."""
        return self.solver.step is not None and not self._stochastic[self.step_index]

    def solver_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors of the current solver step: (sigma, its coefficients from the plan). RuntimeError when the
        step needs the previous step's history and the state has none (a fork that lost it)."""
        k = self.step_index
        if self.solver_plan.uses_history[k] and self.solver_state.prev_x0 is None:
            raise RuntimeError(f"request {self.request_id}: step {k} of solver {self.params.solver!r} needs the "
                               f"previous step's history and its solver_state has none")
        return self.dev_sigmas[k], self.dev_solver_coefficients[k]

    def draw_step_noise(self) -> torch.Tensor:
        """This step's noise on the device, drawn from the request's generator (advancing it) inside the SDE window;
        outside it (or for an ODE request) zeros, and nothing is drawn. Call exactly once per `sde_step` step, in step
        order: the draws are what make the sample reproducible."""
        if not self._stochastic[self.step_index]:
            return torch.zeros_like(self.latents)
        segment = noise_segment(self.params.noise_seeds, self.step_index)
        if segment != self.noise_segment:  # a new branch of a tree: its noise comes from its own seed from here on
            self.generator = make_generator(self.params.noise_seeds[segment][1], self.device)
            self.noise_segment = segment
        return torch.randn(self.latents.shape, generator=self.generator, dtype=torch.float32, device=self.device)

    def prefix_state(self, with_noise: bool) -> "PrefixState":
        """What another sample that shares this one's first `step_index` steps takes over from it (a fork or a
        hand-over, `omniroll.engine.prefix_tree`): copies of the latent and the solver history, the steps' weight
        versions and what was recorded; with `with_noise` (the steps drew noise the other shares) the noise
        generator's state too."""
        gen = None
        if with_noise:
            gen = (self.generator.get_state(), self.noise_segment)
        return PrefixState(self.step_index, self.latents.clone(), self.solver_state.copy(), list(self.step_versions),
                           list(self.rec_latents), list(self.rec_log_probs), list(self.rec_steps), gen)

    def take_prefix(self, state: "PrefixState") -> None:
        """Continue from `state` (another sample's `prefix_state`), as if this sample had run those steps itself."""
        self.step_index = state.step_index
        self.latents = state.latents.clone()
        self.solver_state = state.solver_state.copy()
        self.step_versions = list(state.step_versions)
        self.rec_latents, self.rec_log_probs = list(state.rec_latents), list(state.rec_log_probs)
        self.rec_steps = list(state.rec_steps)
        if state.generator is not None:
            gen_state, self.noise_segment = state.generator
            self.generator = make_generator(0, self.device)
            self.generator.set_state(gen_state)

    def advance(self, new_latents: torch.Tensor, log_prob: torch.Tensor,
                solver_state: SolverState = SolverState()) -> None:
        """Apply one step's result (and the weight version that ran it, and the solver's new history: none after an
        `sde_step` step); record it when the step is in the window and the request asked for log-probs (a request
        without them keeps no trajectory: only its final latent)."""
        self.step_versions.append(int(self.running_version or 0))
        self.solver_state = solver_state
        if self.in_window and self.params.logprobs:
            if not self.rec_latents:
                self.rec_latents.append(self.latents)
            self.rec_latents.append(new_latents)
            self.rec_log_probs.append(log_prob)
            self.rec_steps.append(self.step_index)
        self.latents = new_latents
        self.step_index += 1


def noise_segment(noise_seeds, step: int) -> int:
    """The index of the `noise_seeds` pair whose generator draws step `step`'s noise (-1: the request's own seed)."""
    segment = -1
    for i, (start, _) in enumerate(noise_seeds or ()):
        if start <= step:
            segment = i
    return segment


@dataclass(frozen=True)
class PrefixState:
    """A sample's state after its first `step_index` steps, for another sample that shares them
    (`RequestState.prefix_state`, `take_prefix`). `generator`: (the noise generator's state, its segment) or None."""

    step_index: int
    latents: torch.Tensor
    solver_state: SolverState
    step_versions: list
    rec_latents: list
    rec_log_probs: list
    rec_steps: list
    generator: Optional[tuple] = None
