"""The model-adapter interface: everything the engine needs from a model family, nothing more (what a checkpoint
directory says before any weight loads is models/checkpoint.py's).

An adapter wraps one family's diffusers / transformers classes. The engine owns the denoise loop; an adapter only
answers: how to encode a prompt, what the velocity is for a batch of latents at per-row timesteps, how to combine a
conditional and an unconditional velocity (CFG), how to decode latents to pixels, and which latent shape and sigma
schedule a request gets.

Shapes are generic: one sample's latent is whatever `latent_shape(height, width, num_frames)` says (SD3 / FLUX /
Qwen-Image: [C, h, w]; Wan: [C, t, h, w]), always unpacked (an adapter that packs 2x2 patches for its transformer
packs and unpacks inside `velocity`, a pure permutation). `decode` gives [B, 3, H, W] for images and
[B, T, 3, H, W] for video, floats in [-1, 1].
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from omniroll.library_warnings import silence_library_warnings
from omniroll.models.checkpoint import DEFAULT_MAX_SEQUENCE_LENGTH, ModelLimits, require_checkpoint


#: the CFG scale of a row that runs no unconditional row, in the engine and in every trajectory alike.
NO_CFG = 0.0


def is_sequence_embedding(key: str) -> bool:
    """A per-token prompt embedding (`prompt_embeds`, `negative_prompt_embeds`, ...: [L, D], padded when rows are
    stacked), not a pooled one."""
    return key.endswith("prompt_embeds") and not key.endswith("pooled_prompt_embeds")


def is_conditioning(key: str) -> bool:
    """A tensor of the adapter's `cond` dict (`*prompt_embeds`, pooled ones included), not a negative prompt's."""
    return key.endswith("prompt_embeds") and not key.startswith("negative_")


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


def denoiser_experts(denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """A denoiser's transformers by their checkpoint folder, each a diffusers model (`add_adapter`,
    `save_pretrained`, `enable_gradient_checkpointing`): {"transformer": denoiser}, or, for a two-expert model (Wan 2.2
    A14B: the denoiser is a ModuleDict of them), {"transformer": ..., "transformer_2": ...}."""
    if isinstance(denoiser, torch.nn.ModuleDict):
        return dict(denoiser.items())
    return {"transformer": denoiser}


def check_int(name: str, value, lo: int, hi: Optional[int] = None) -> None:
    """Raise ValueError naming `name` unless `value` is an int in [lo, hi]."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int {rng}, got {value!r}")


def check_pipeline(pipeline, cls: type, family: str, components: tuple[str, ...]) -> None:
    """The one check every adapter's constructor makes: `pipeline` is a `cls` and has every named component."""
    if not isinstance(pipeline, cls):
        raise TypeError(f"pipeline must be a {cls.__name__}, got {type(pipeline).__name__}")
    for name in components:
        if getattr(pipeline, name, None) is None:
            raise ValueError(f"{family} checkpoint is missing component {name!r}")


def load_pipeline(class_name: str, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a diffusers pipeline (by class name) from a local checkpoint directory, offline, onto `device`."""
    silence_library_warnings()  # before diffusers imports the pipeline (and transformers' image processors)
    import diffusers
    from diffusers.utils import deprecation_utils

    path = os.fspath(path)
    require_checkpoint(path)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    # diffusers renamed `torch_dtype` to `dtype` (0.36+); use whichever this version understands.
    dtype_key = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    pipe = getattr(diffusers, class_name).from_pretrained(path, local_files_only=True, **{dtype_key: dtype})
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    return pipe


class DiffusionAdapter(ABC):
    """One model family. Subclasses keep their diffusers modules as attributes and set `pipeline_class`."""

    #: the diffusers pipeline class (by name) whose components and helpers the adapter uses.
    pipeline_class: str = ""
    #: the family's name in errors, and the pipeline components a checkpoint of it must have.
    family: str = ""
    components: tuple[str, ...] = ()

    #: modules whose weights the trainer may update (name -> module); the denoiser is always "transformer".
    trainable_module_name: str = "transformer"
    #: PEFT `target_modules` of this family's denoiser (what a Flow-GRPO LoRA adapts); weight sync binds to them.
    lora_target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    #: "cfg": guidance_scale > 1 adds an unconditional row and mixes (`mix_cfg`); "distilled": guidance_scale is an
    #: input of the model (FLUX.1), no extra row unless `true_cfg_scale` > 1.
    guidance_kind: str = "cfg"
    #: how many denoisers the family switches between by timestep (Wan 2.2 A14B: 2).
    num_experts: int = 1
    #: the dtype the denoiser's forward computes in under `torch.autocast` when its weights are kept wider (the
    #: trainer's fp32 master weights of full fine-tuning); None: its weights' own dtype (the engine, a LoRA policy)
    autocast_dtype: Optional[torch.dtype] = None

    @abstractmethod
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning]:
        """Encode each prompt to its own Conditioning (the empty string is the unconditional branch)."""

    def tokenize(self, prompt: str, max_sequence_length: int) -> dict[str, list[int]]:
        """The per-encoder token ids the text path encodes for `prompt` (unpadded, with special tokens): what a
        trainer that tokenizes on its side sends as `prompt_token_ids`."""
        raise NotImplementedError(f"{type(self).__name__} does not take token-id prompts")

    def check_token_ids(self, token_ids: dict, max_sequence_length: int, field: str = "prompt_token_ids") -> None:
        """Raise ValueError naming `field` when `token_ids` cannot be encoded (called before any work starts)."""
        raise ValueError(f"{field}: {type(self).__name__} does not take token-id prompts; send text")

    def encode_token_ids(self, token_ids: list[dict[str, list[int]]], max_sequence_length: int) -> list[Conditioning]:
        """Encode prompts given as per-encoder token ids; bitwise what `encode_prompts` gives for the text those
        ids came from (`tokenize`)."""
        raise NotImplementedError(f"{type(self).__name__} does not take token-id prompts")

    @abstractmethod
    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 guidance: Optional[torch.Tensor] = None, expert: int = 0) -> torch.Tensor:
        """Velocity v for latents [B, ...] at per-row timesteps [B] (sigma * 1000), fp32 out, on the latents'
        device. `guidance` [B]: per-row distilled guidance (guidance_kind "distilled" only). `expert`: which
        denoiser (every row of one call uses the same one; see `expert_index`). Differentiable: the engine calls it
        under `torch.no_grad`; the trainer's recompute (`omniroll.train.recompute_log_probs`) with autograd on, through
        the very same code."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents [B, ...] to float pixels in [-1, 1] (un-quantized): [B, 3, H, W] or [B, T, 3, H, W]."""

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """fp32 latents [B, ...] of pixels in [-1, 1] laid out as `decode` returns them: the VAE posterior's mean, in
        the normalisation `decode` inverts (what the denoiser draws). NotImplementedError for a family without it."""
        raise NotImplementedError(f"{type(self).__name__}: encoding pixels to latents is not implemented for this "
                                  f"family (SD3 and Wan have it)")

    @abstractmethod
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """Shape of one sample's latent (no batch dimension) for a pixel resolution and frame count."""

    @abstractmethod
    def sigmas(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Sigma schedule [T + 1], fp32, from 1 (noise) down to 0 (data)."""

    @abstractmethod
    def modules(self) -> dict[str, torch.nn.Module]:
        """Every torch module the adapter holds (for sleep / wake and device moves)."""

    # ------------------------------------------------------------------ construction, shared by every family
    def _adopt(self, pipeline) -> None:
        """The start of every family's constructor: `pipeline` is a `pipeline_class` with every component; keep it,
        its VAE and its scheduler's config; an empty sigma cache."""
        import diffusers

        check_pipeline(pipeline, getattr(diffusers, self.pipeline_class), self.family, self.components)
        self.pipeline = pipeline
        self.vae = pipeline.vae
        self.scheduler_config = dict(pipeline.scheduler.config)
        self._sigma_cache: dict = {}

    def _eval_mode(self) -> None:
        """The end of every family's constructor: every module in eval mode (no dropout anywhere: the rollout and the
        trainer's recompute must compute one function)."""
        for m in self.modules().values():
            m.eval()

    # ------------------------------------------------------------------ defaults most families keep
    @classmethod
    def from_pretrained(cls, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        """Load every component from a local diffusers checkpoint directory (offline)."""
        return cls(load_pipeline(cls.pipeline_class, path, device=device, dtype=dtype))

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.denoiser.parameters()).dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the denoiser's forward computes in: `autocast_dtype`, else its weights' own."""
        return self.autocast_dtype or self.dtype

    def autocast(self):
        """`torch.autocast` in `autocast_dtype` on the denoiser's device (nothing when it is None)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def check_num_frames(self, num_frames: int) -> None:
        """Image families take exactly one frame."""
        if num_frames != 1:
            raise ValueError(f"num_frames must be 1 for the image model {type(self).__name__}, got {num_frames!r}")

    def check_guidance(self, guidance_scale: float, true_cfg_scale: float) -> None:
        """Only guidance-distilled families take a separate true CFG scale."""
        if true_cfg_scale != 1.0 and self.guidance_kind != "distilled":
            raise ValueError(f"true_cfg_scale must be 1.0 for {type(self).__name__} (its guidance_scale is the CFG "
                             f"scale), got {true_cfg_scale}")

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float = 1.0) -> float:
        """The CFG mixing scale of a request, or `NO_CFG` when it runs no unconditional row."""
        scale = true_cfg_scale if self.guidance_kind == "distilled" else guidance_scale
        return float(scale) if scale > 1.0 else NO_CFG

    def mix_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance for one row: uncond + scale * (cond - uncond)."""
        return uncond + scale * (cond - uncond)

    def guided_velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                        uncond: Optional[dict[str, torch.Tensor]], cfg_scale: list[float],
                        guidance: Optional[torch.Tensor] = None, expert: int = 0) -> torch.Tensor:
        """Velocity after CFG [B, ...] (fp32) for rows that share a conditioning shape and a denoiser: the one
        function the engine's step and the trainer's recompute both call, so the two cannot drift apart.

        `cfg_scale[i]` is row i's CFG scale (`NO_CFG`: none); `uncond` holds one row per CFG row, in row order.
        One forward runs every row, then the unconditional copies of the CFG rows (same latent, timestep and
        distilled `guidance`); each CFG row is then `mix_cfg(cond, uncond, cfg_scale[i])`."""
        B = latents.shape[0]
        cfg = [i for i, g in enumerate(cfg_scale) if g != NO_CFG]
        if cfg:
            latents = torch.cat([latents, latents[cfg]])
            timesteps = torch.cat([timesteps, timesteps[cfg]])
            cond = {k: torch.cat([cond[k], uncond[k]]) for k in cond}
            if guidance is not None:
                guidance = torch.cat([guidance, guidance[cfg]])
        with self.autocast():
            v_all = self.velocity(latents, timesteps, cond, guidance=guidance, expert=expert)
        v_all = v_all.float()
        v = list(v_all[:B].unbind(0))
        for j, i in enumerate(cfg):
            v[i] = self.mix_cfg(v[i], v_all[B + j], cfg_scale[i])
        return torch.stack(v)

    def expert_index(self, timestep: float) -> int:
        """Which denoiser runs at this timestep (sigma * 1000); 0 for single-denoiser families."""
        return 0

    @property
    def is_video(self) -> bool:
        return False

    @classmethod
    def prompt_ids_length(cls, path: str) -> int | None:
        """How many prompt token ids this family reports per prompt (the main tokenizer's padded length), read from
        the checkpoint's files without loading any model; None when it is not fixed or not known."""
        return None

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
        (`limits_from_files` / `omniroll.models.read_limits` give the same object from the config files alone)."""
        return ModelLimits(self.spatial_multiple, self.max_resolution, self.max_sequence_length_limit)

    @classmethod
    def limits_from_files(cls, path: str) -> Optional[ModelLimits]:
        """This family's `limits` read from the checkpoint's config files alone (no weights), or None when the family
        does not implement it (then requests are checked when they reach the engine)."""
        return None
