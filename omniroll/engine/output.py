"""`DiffusionOutput`: one finished (or aborted) sample, with everything RL needs."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict


class DiffusionOutput(BaseModel):
    """The specification's fields.

    diffusion_output: uint8 [3, H, W] pixels, [T, 3, H, W] for video (or fp32 latents for output_type="latent").
    log_probs: fp32 [W] log-probs of the recorded SDE steps (None when not requested).
    stop_reason: "completed" | "aborted".
    num_preempted: times the request sat out a step it was ready for.
    extra_fields: all_latents [W+1, ...] fp32, all_timesteps [W], sigmas [W], sigmas_next [W], noise_level,
        sde_type, sigma_max, window, seed, prompt embeddings, ...; the weight versions `weight_version` (the version
        that ran the first step), `step_weight_versions` ([W] ints: the version that ran each recorded step) and
        `min_weight_version` / `max_weight_version` (see `omniroll.engine.output_assembly`); `expert_indices` [W] (the
        denoiser of each recorded step) for multi-expert models (Wan 2.2 A14B); `fps` for video.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    diffusion_output: Any
    log_probs: Optional[Any] = None
    stop_reason: Optional[str] = None
    num_preempted: Optional[int] = None
    extra_fields: dict[str, Any] = {}

    @property
    def request_id(self) -> Optional[str]:
        return self.extra_fields.get("request_id")

    @property
    def weight_version(self) -> int:
        return int(self.extra_fields.get("weight_version", 0))

    @property
    def step_weight_versions(self) -> list[int]:
        """The weight version that ran each recorded window step (one per log-prob)."""
        return [int(v) for v in self.extra_fields.get("step_weight_versions", [])]
