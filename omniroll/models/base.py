"""The model-adapter interface: everything the engine needs from a model family, nothing more.

An adapter wraps one family's diffusers / transformers classes. The engine owns the denoise loop; an adapter only
answers four questions: how to encode a prompt, what the velocity is for a batch of latents at per-row timesteps, how
to decode latents to pixels, and which latent shape and sigma schedule a request gets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from omniroll.models.checkpoint import DEFAULT_MAX_SEQUENCE_LENGTH, ModelLimits


@dataclass
class Conditioning:
    """Text conditioning of ONE prompt (no batch dimension).

    `tensors` holds what the denoiser consumes (e.g. SD3: `prompt_embeds` [L, D], `pooled_prompt_embeds` [P]).
    Rows whose `shape_key` match can be stacked into one forward. `prompt_ids` are token ids of the main tokenizer,
    reported to the trainer as `prompts`.
    """

    tensors: dict[str, torch.Tensor]
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def shape_key(self) -> tuple:
        return tuple((k, tuple(v.shape)) for k, v in sorted(self.tensors.items()))

    def to(self, device: torch.device | str) -> "Conditioning":
        return Conditioning({k: v.to(device) for k, v in self.tensors.items()}, list(self.prompt_ids))


def stack_conditioning(conds: list[Conditioning]) -> dict[str, torch.Tensor]:
    """Stack one-row conditionings into batched tensors (all must share a shape_key)."""
    keys = conds[0].tensors.keys()
    return {k: torch.stack([c.tensors[k] for c in conds]) for k in keys}


class DiffusionAdapter(ABC):
    """One model family. Subclasses keep their diffusers modules as attributes."""

    #: modules whose weights the trainer may update (name -> module); the denoiser is always "transformer".
    trainable_module_name: str = "transformer"

    @abstractmethod
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning]:
        """Encode each prompt to its own Conditioning (the empty string is the unconditional branch)."""

    @abstractmethod
    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """Velocity v for latents [B, ...] at per-row timesteps [B] (sigma * 1000), fp32 out."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents [B, ...] to float pixels in [-1, 1] (un-quantized), [B, 3, H, W]."""

    @abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one sample's latent (no batch dimension) for a pixel resolution."""

    @abstractmethod
    def sigmas(self, num_inference_steps: int, height: int, width: int) -> torch.Tensor:
        """Sigma schedule [T + 1], fp32, from 1 (noise) down to 0 (data)."""

    @abstractmethod
    def modules(self) -> dict[str, torch.nn.Module]:
        """Every torch module the adapter holds (for sleep / wake and device moves)."""

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.modules()[self.trainable_module_name]

    @property
    def spatial_multiple(self) -> int:
        """Height and width must be multiples of this."""
        return 16

    @property
    def max_resolution(self):
        """Largest height / width (None: unbounded)."""
        return None

    @property
    def max_sequence_length_limit(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    @property
    def limits(self) -> ModelLimits:
        """What a request may ask of this model; `ModelLimits.check` is the one check of resolution and text length
        (`omniroll.models.read_limits` gives the same object from the checkpoint's config files alone)."""
        return ModelLimits(self.spatial_multiple, self.max_resolution, self.max_sequence_length_limit,
                           self.prompt_token_length)

    @property
    def prompt_token_length(self):
        """Token ids per prompt from the main tokenizer (padded), or None."""
        return None
