"""The engine's model calls: one denoising step for a batch of rows (`ModelRunner.step`: a single batched forward,
CFG rows included, then each row's step: the SDE step, or its solver's) and the decode of finished samples, each
inside the execution mode of engine/execution.py (batch-invariant kernels), which the trainer's recompute enters too.

With `row_threads` > 1 (engine/row_threads.py) a step's rows run as several forwards at once, and a decode's blocks
too, each on its own thread at one torch thread.

Everything stays on the engine's device: the rows' latents, timesteps, sigmas, noise levels, solver coefficients and
noise are device tensors held by their RequestStates, the CFG mix and the steps run where the velocity is, and nothing
is read back to the host, so a step queues its kernels without waiting for the previous step to finish.
"""

from __future__ import annotations

import torch

from omniroll.engine.config import EngineConfig
from omniroll.engine.execution import execution_mode
from omniroll.engine.request import RequestState
from omniroll.engine.row_threads import RowThreads
from omniroll.models.base import NO_CFG, DiffusionAdapter, stack_conditioning
from omniroll.sampling import sde_step
from omniroll.weights import weights_digest


class ModelRunner:
    def __init__(self, adapter: DiffusionAdapter, config: EngineConfig):
        self.adapter = adapter
        self.config = config
        self.device = torch.device(config.device)
        self.row_threads = RowThreads(config.row_threads) if config.row_threads > 1 else None

    def execution_mode(self):
        """The context every model call runs in (batch-invariant when configured)."""
        return execution_mode(self.execution_info())

    def execution_info(self) -> dict:
        """How this engine's model calls run; recorded in every trajectory (`extra_fields["execution"]`), so a
        trainer's recompute enters the same mode with the same block size and dtype without copying them by hand,
        and knows whether a LoRA adapter ran merged (which its recompute, the adapter unmerged, does not reproduce
        bitwise)."""
        return {"batch_invariant": bool(self.config.batch_invariant),
                "invariant_block_rows": int(self.config.invariant_block_rows),
                "dtype": str(self.config.dtype).removeprefix("torch."), "merge_lora": bool(self.config.merge_lora)}

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """Advance every state by one step. Each row keeps its own sigma, guidance, noise level, SDE type, window and
        solver. All rows share a batch key, hence a latent shape and a denoiser (`expert`)."""
        # 1. The velocity of every row: one forward for the batch, CFG rows included.
        #    With row threads: one forward per share of the rows, at once (the same bits in batch-invariant mode).
        inputs = [s.step_inputs() for s in states]  # (timestep, sigma, sigma_next, noise_level, sde_code)
        latents = torch.stack([s.latents for s in states])
        if self.row_threads is None:
            v = self._velocity(states, [x[0] for x in inputs], latents)
        else:
            spans = self.row_threads.spans([s.num_rows for s in states])
            v = torch.cat(self.row_threads.map(
                lambda span: self._velocity(states[span[0]:span[1]], [x[0] for x in inputs[span[0]:span[1]]]), spans))

        # 2. Which rows take a solver's step (a deterministic step of a solver other than euler, sampling/solvers.py);
        #    every other row takes `sde_step`: its SDE window's step, or at noise level 0 the Euler step.
        by_solver: dict[str, list[int]] = {}
        for i, s in enumerate(states):
            if s.takes_solver_step:
                by_solver.setdefault(s.params.solver, []).append(i)
        solved = {i for rows in by_solver.values() for i in rows}
        sde_rows = [i for i in range(len(states)) if i not in solved]
        results: dict[int, tuple] = {}  # row -> (new latents, log-prob, solver state): `advance`'s arguments

        # 3. The `sde_step` rows (all of them, in one call, when no row takes a solver's step).
        if sde_rows:
            rows_in = [inputs[i] for i in sde_rows]
            out = sde_step(
                _pick(latents, sde_rows), _pick(v, sde_rows),
                torch.stack([x[1] for x in rows_in]), torch.stack([x[2] for x in rows_in]),
                noise_level=torch.stack([x[3] for x in rows_in]),
                sde_type=torch.stack([x[4] for x in rows_in]),
                noise=torch.stack([states[i].draw_step_noise() for i in sde_rows]),
                sigma_max=torch.stack([states[i].dev_sigma_max for i in sde_rows]),
            )
            for j, i in enumerate(sde_rows):
                results[i] = (out.prev_sample[j].clone(), out.log_prob[j].clone())

        # 4. Each solver's rows: its step, and the history it carries to their next step (a deterministic step's
        #    log-prob is 0, as `sde_step` reports it).
        for rows in by_solver.values():
            solver_in = [states[i].solver_inputs() for i in rows]  # (sigma, coefficients)
            new, history = states[rows[0]].solver.step(
                _pick(latents, rows), _pick(v, rows), torch.stack([x[0] for x in solver_in]),
                torch.stack([x[1] for x in solver_in]), [states[i].solver_state for i in rows])
            for j, i in enumerate(rows):
                results[i] = (new[j].clone(), new.new_zeros(()), history[j])

        # 5. Apply the results.
        for i, s in enumerate(states):
            s.advance(*results[i])

    def _velocity(self, states: list[RequestState], timesteps: list[torch.Tensor],
                  latents: torch.Tensor | None = None) -> torch.Tensor:
        """The guided velocity of `states`' rows: one forward, CFG rows included, in the execution mode (entered
        here, with no_grad: both are per thread, and a row thread calls this). `latents`: their stacked latents when
        the caller has them."""
        cfg = [s for s in states if s.cfg_scale != NO_CFG]
        if latents is None:
            latents = torch.stack([s.latents for s in states])
        guidance = None
        if self.adapter.guidance_kind == "distilled":
            guidance = torch.stack([s.dev_guidance for s in states])
        with torch.no_grad(), self.execution_mode():
            return self.adapter.guided_velocity(
                latents, torch.stack(timesteps), stack_conditioning([s.cond for s in states]),
                stack_conditioning([s.uncond for s in cfg]) if cfg else None, [s.cfg_scale for s in states],
                guidance=guidance, expert=states[0].expert,
            )

    def sample_identity(self) -> dict:
        """What a sample's pixels depend on besides its request: the digest of the weights as they compute
        (`omniroll.weights.weights_digest`: every component, a merged adapter counted in its base layers), the
        execution mode, decode block, device, torch threads, torch and diffusers versions. In batch-invariant mode
        equal identities draw a request with the same bits (`omniroll.evaluation.cache` keys kept evaluations on it).
        Call it between two steps (`DiffusionEngine.sample_identity`)."""
        import diffusers

        return {"weights": weights_digest(self.adapter.modules()), "execution": self.execution_info(),
                "decode_batch_size": int(self.config.decode_batch_size), "device": str(self.config.device),
                "torch_threads": 1 if self.row_threads else torch.get_num_threads(), "torch": torch.__version__,
                "diffusers": diffusers.__version__}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Float pixels [-1, 1] on the host for latents [B, ...] ([B, 3, H, W] or [B, T, 3, H, W]), in blocks of
        `decode_batch_size` samples; the only device-to-host copy of a request's pixels. In batch-invariant mode every
        block has exactly that many samples (zero latents pad the last one): at one fixed batch shape the VAE's
        kernels give a sample the same bits whatever its position and block mates (tested), while another batch size
        may move them (~1e-5), so a sample's pixels never depend on what finished with it."""
        block = self.config.decode_batch_size

        def decode_block(chunk: torch.Tensor) -> torch.Tensor:
            n = chunk.shape[0]
            if self.config.batch_invariant and n < block:
                chunk = torch.cat([chunk, chunk.new_zeros((block - n,) + tuple(chunk.shape[1:]))])
            with torch.no_grad():  # per thread: a row thread runs this too
                return self.adapter.decode(chunk.to(self.device)).float().cpu()[:n]

        chunks = list(latents.split(block))
        if self.row_threads is None:
            return torch.cat([decode_block(c) for c in chunks])
        return torch.cat(self.row_threads.map(decode_block, chunks))

    def shutdown(self) -> None:
        """Stop the row threads (if any); idle ones exit at once."""
        if self.row_threads is not None:
            self.row_threads.shutdown()


def _pick(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows `rows` of `t` ([B, ...]): `t` itself when they are all of them (in order), else a stacked copy
    (indexed one by one: a device index tensor would copy `rows` to the device every step)."""
    if rows == list(range(t.shape[0])):
        return t
    return torch.stack([t[i] for i in rows])
