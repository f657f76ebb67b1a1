"""How a finished (or aborted) `RequestState` becomes a `DiffusionOutput`: the trajectory's one copy to the host,
uint8 pixels (`quantize_pixels`), the sampling facts a trainer needs, the prompt encodings as copies, and the weight
versions (`build_output`, `aborted_output`).

Weight versions in every output's `extra_fields` (a weight update with `partial=True` lands between two denoising
steps of samples in flight, so one sample may run on several versions; versions never decrease):

  weight_version        the version that ran the sample's first denoising step (a prefix follower: its leader's);
                        for a sample that ran no step (aborted early), the version at admission, else the engine's
                        version when it was aborted. When no update landed while the sample ran (always so with the
                        default `partial=False` sync, which waits for or aborts the samples in flight), every step
                        ran with it.
  step_weight_versions  [W] ints: the version that ran each recorded window step, in the order of `log_probs`,
                        `all_timesteps`, `step_indices` (a recompute of window step k must use version
                        `step_weight_versions[k]`).
  min_weight_version,   min / max of `step_weight_versions` (the versions behind the recorded log-probs); a sample
  max_weight_version    with no recorded step (aborted before its window) reports `weight_version` for both.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from omniroll.engine.output import DiffusionOutput
from omniroll.engine.request import RequestState


def quantize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """Float pixels in [-1, 1] -> uint8, once: clamp, scale to [0, 255], round. NaN / Inf raise."""
    if not torch.isfinite(pixels).all():
        raise FloatingPointError("decoded pixels contain NaN or Inf; refusing to quantize a corrupt sample")
    x = (pixels.float() / 2 + 0.5).clamp(0.0, 1.0)  # the same expression as diffusers postprocess
    return (x * 255.0).round().to(torch.uint8)


def _embedding_fields(state: RequestState) -> dict:
    """The prompt encodings, as copies: the engine's prompt cache keeps the originals for later requests, so an
    output never aliases them (a trainer normalising an output in place must not change later samples)."""
    fields = {}
    if state.cond is not None:
        fields.update({k: v.to("cpu", copy=True) for k, v in state.cond.tensors.items()})
        fields["prompt_ids"] = list(state.cond.prompt_ids)
    if state.uncond is not None:
        fields.update({f"negative_{k}": v.to("cpu", copy=True) for k, v in state.uncond.tensors.items()})
    return fields


def version_fields(state: RequestState, current_version: int) -> dict:
    """The weight-version fields of an output (documented above); `current_version`: the engine's version now."""
    if state.step_versions:
        first = state.step_versions[0]
    else:
        first = state.admitted_version if state.admitted_version is not None else current_version
    window = [int(state.step_versions[k]) for k in state.rec_steps]
    return {"weight_version": int(first), "step_weight_versions": window,
            "min_weight_version": min(window, default=int(first)),
            "max_weight_version": max(window, default=int(first))}


def build_output(state: RequestState, pixels: Optional[torch.Tensor],
                 execution: Optional[dict] = None) -> DiffusionOutput:
    """Package what RL needs. The window's sigmas, noise level and SDE type travel with the trajectory, so a trainer
    never has to recover sigma from a timestep or mirror the sampling config."""
    p = state.params
    steps = torch.tensor(state.rec_steps, dtype=torch.long)
    # The one device-to-host copy of the request's trajectory.
    if state.rec_latents:
        all_latents = torch.stack(state.rec_latents).cpu()
    else:
        all_latents = torch.empty((0,) + tuple(state.latents.shape))
    log_probs = torch.stack(state.rec_log_probs).cpu() if state.rec_log_probs else torch.empty(0)
    latents = state.latents.cpu()
    if p.output_type == "latent":
        primary = latents
    else:
        primary = quantize_pixels(pixels)  # [3, H, W] or, for video, [T, 3, H, W]
    extra = {
        "request_id": state.request_id,
        "all_latents": all_latents,
        "all_timesteps": state.timesteps[steps],  # an empty index gives an empty tensor
        "sigmas": state.sigmas[steps],
        "sigmas_next": state.sigmas[steps + 1],
        "step_indices": steps,
        "sde_window": tuple(state.window),
        "noise_level": float(p.noise_level) if p.stochastic else 0.0,
        "sde_type": p.sde_type if p.stochastic else "ode",
        "sigma_max": float(state.sigma_max),
        "guidance_scale": float(p.guidance_scale),
        "cfg_scale": float(state.cfg_scale),  # the CFG mix's scale; NO_CFG (0.0): none
        "seed": int(state.request.seed),
        "sampling_params": p.model_dump(mode="json"),  # what this row was asked for, as given
        **version_fields(state, 0),
        "execution": dict(execution or {}),  # batch_invariant, invariant_block_rows, dtype (ModelRunner)
        "generate_seconds": time.time() - state.submitted_at,
        **_embedding_fields(state),
    }
    if state.experts is not None:  # which denoiser ran each recorded step (Wan 2.2: 0 high-noise, 1 low-noise)
        extra["expert_indices"] = torch.tensor(state.experts, dtype=torch.long)[steps]
    if p.num_frames > 1:
        extra["fps"] = int(p.fps)
    if p.output_type == "both":
        extra["latents"] = latents
    return DiffusionOutput(
        diffusion_output=primary,
        log_probs=log_probs if p.logprobs else None,
        stop_reason="completed",
        num_preempted=state.num_preempted,
        extra_fields=extra,
    )


def aborted_output(state: RequestState, weight_version: int) -> DiffusionOutput:
    """An aborted request: no pixels, no trajectory, an explicit stop reason. `weight_version`: the engine's now."""
    return DiffusionOutput(
        diffusion_output=torch.empty((0,), dtype=torch.uint8),
        log_probs=None,
        stop_reason="aborted",
        num_preempted=state.num_preempted,
        extra_fields={
            "request_id": state.request_id,
            "seed": int(state.request.seed),
            **version_fields(state, weight_version),
            "steps_done": state.step_index,
        },
    )
