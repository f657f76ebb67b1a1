"""Stable Diffusion 3 / 3.5 adapter: diffusers' own components and prompt encoding, the engine's denoise loop."""

from __future__ import annotations

import torch

from omniroll.models.base import Conditioning, DiffusionAdapter
from omniroll.models.checkpoint import (DEFAULT_MAX_SEQUENCE_LENGTH, ModelLimits, read_sd3_limits,
                                        tokenizer_max_length, tokenizer_padded_length)


class SD3Adapter(DiffusionAdapter):
    """Wraps a loaded `StableDiffusion3Pipeline` (its `__call__` is never run).

    The pipeline object is kept only to reuse `encode_prompt` and to hold the components; the engine calls
    `velocity` / `decode` and drives the sampler itself. CFG: guidance_scale > 1 adds an unconditional row.
    """

    pipeline_class = "StableDiffusion3Pipeline"
    #: Flow-GRPO's SD3 LoRA: both streams' attention projections.
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

    family = "SD3"
    components = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")

    def __init__(self, pipeline):
        self._adopt(pipeline)
        self.transformer = pipeline.transformer
        self.text_encoder = pipeline.text_encoder
        self.text_encoder_2 = pipeline.text_encoder_2
        self.text_encoder_3 = pipeline.text_encoder_3  # may be None (SD3 without T5: zeros, as diffusers does)
        self.tokenizer = pipeline.tokenizer
        self.tokenizer_3 = pipeline.tokenizer_3
        self._eval_mode()

    @classmethod
    def limits_from_files(cls, path: str) -> ModelLimits:
        return read_sd3_limits(path)

    @classmethod
    def prompt_ids_length(cls, path: str) -> int | None:
        """CLIP's `model_max_length` from `tokenizer/tokenizer_config.json`: `encode_prompts` pads ids to it."""
        return tokenizer_padded_length(path)

    # ------------------------------------------------------------------ properties
    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def patch_size(self) -> int:
        return int(self.transformer.config.patch_size)

    @property
    def spatial_multiple(self) -> int:
        return self.vae_scale_factor * self.patch_size

    @property
    def max_resolution(self) -> int:
        """Largest height / width the transformer's positional embedding covers (None in config: unbounded)."""
        max_pos = self.transformer.config.pos_embed_max_size
        return None if max_pos is None else int(max_pos) * self.spatial_multiple

    @property
    def max_sequence_length_limit(self) -> int:
        if self.tokenizer_3 is None:
            return DEFAULT_MAX_SEQUENCE_LENGTH
        return tokenizer_max_length(getattr(self.tokenizer_3, "model_max_length", None))

    def modules(self) -> dict[str, torch.nn.Module]:
        mods = {
            "transformer": self.transformer,
            "vae": self.vae,
            "text_encoder": self.text_encoder,
            "text_encoder_2": self.text_encoder_2,
            "text_encoder_3": self.text_encoder_3,
        }
        return {k: v for k, v in mods.items() if v is not None}

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning]:
        """One Conditioning per prompt via diffusers' `encode_prompt`.

        Prompts are encoded one at a time, so a prompt's tensors never depend on what else is in the list (batched
        matmuls may pick different kernels per batch size). Duplicates are encoded once and copied.
        """
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        self.limits.check(max_sequence_length=max_sequence_length)
        device = next(self.text_encoder.parameters()).device
        encoded: dict[str, Conditioning] = {}
        for prompt in dict.fromkeys(prompts):
            prompt_embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompt=[prompt], prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
                do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
            )
            ids = self.tokenizer(  # padded like diffusers' CLIP branch
                prompt, padding="max_length", max_length=self.pipeline.tokenizer_max_length, truncation=True
            ).input_ids
            encoded[prompt] = Conditioning(
                {"prompt_embeds": prompt_embeds[0].float(), "pooled_prompt_embeds": pooled[0].float()},
                [int(i) for i in ids],
            )
        return [
            Conditioning({k: v.clone() for k, v in encoded[p].tensors.items()}, list(encoded[p].prompt_ids))
            for p in prompts
        ]

    # ------------------------------------------------------------------ prompts as token ids
    def _clip_tokenizers(self) -> tuple:
        return (self.tokenizer, self.pipeline.tokenizer_2)

    def tokenize(self, prompt: str, max_sequence_length: int) -> dict[str, list[int]]:
        """`{"clip", "t5"}` ids (unpadded, with special tokens) exactly as the text path tokenizes `prompt`; a
        `"clip_2"` entry only where the second CLIP tokenizer gives other ids (never, when the two share a vocabulary,
        as in SD3 / SD3.5: one CLIP tokenization then feeds both CLIP encoders, as VeRL-Omni sends it)."""
        self.limits.check(max_sequence_length=max_sequence_length)
        clip_len = self.pipeline.tokenizer_max_length
        clip, clip_2 = (tok(prompt, max_length=clip_len, truncation=True).input_ids
                        for tok in self._clip_tokenizers())
        ids = {"clip": [int(i) for i in clip]}
        if list(clip_2) != list(clip):
            ids["clip_2"] = [int(i) for i in clip_2]
        if self.tokenizer_3 is not None:
            t5 = self.tokenizer_3(prompt, max_length=max_sequence_length, truncation=True, add_special_tokens=True)
            ids["t5"] = [int(i) for i in t5.input_ids]
        return ids

    def check_token_ids(self, token_ids: dict, max_sequence_length: int, field: str = "prompt_token_ids") -> None:
        self.limits.check(max_sequence_length=max_sequence_length)
        if not isinstance(token_ids, dict):
            raise ValueError(f"{field} must be a dict of per-encoder token ids, got {type(token_ids).__name__}")
        required = ("clip", "t5") if self.tokenizer_3 is not None else ("clip",)
        allowed = ("clip", "clip_2", "t5")
        unknown = sorted(set(token_ids) - set(allowed))
        if unknown or any(k not in token_ids for k in required):
            raise ValueError(f"{field} must have the keys {list(required)} (optional 'clip_2'), "
                             f"got {sorted(token_ids)}")
        clip_len = self.pipeline.tokenizer_max_length
        tokenizers = {"clip": self.tokenizer, "clip_2": self.pipeline.tokenizer_2, "t5": self.tokenizer_3}
        for key, ids in token_ids.items():
            if key == "t5" and self.tokenizer_3 is None:
                continue  # no T5 encoder: its embeddings are zeros, as in diffusers
            limit = max_sequence_length if key == "t5" else clip_len
            vocab = len(tokenizers[key])
            if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= limit:
                raise ValueError(f"{field}.{key} must be a list of 1 to {limit} token ids "
                                 f"({'max_sequence_length' if key == 't5' else 'the CLIP context'}), "
                                 f"got {len(ids) if isinstance(ids, (list, tuple)) else type(ids).__name__}")
            bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
            if bad:
                raise ValueError(f"{field}.{key}: token ids must be ints in [0, {vocab}) (the tokenizer's vocabulary), "
                                 f"got {bad[:3]}")

    @staticmethod
    def _padded(ids: list[int], length: int, tokenizer) -> torch.Tensor:
        """[1, length] ids padded with `tokenizer`'s pad token on its padding side (what padding="max_length"
        gives)."""
        pad = [int(tokenizer.pad_token_id)] * (length - len(ids))
        row = pad + list(ids) if tokenizer.padding_side == "left" else list(ids) + pad
        return torch.tensor([row], dtype=torch.long)

    @torch.no_grad()
    def encode_token_ids(self, token_ids: list[dict[str, list[int]]], max_sequence_length: int) -> list[Conditioning]:
        """The operations of diffusers' `encode_prompt`, from ids instead of text, one prompt at a time (so the
        result is bitwise that of the text the ids came from)."""
        out = []
        for ids in token_ids:
            self.check_token_ids(ids, max_sequence_length)
            device = next(self.text_encoder.parameters()).device
            clip_len = self.pipeline.tokenizer_max_length
            embeds, pooled = [], []
            for tok, enc, key in zip(self._clip_tokenizers(), (self.text_encoder, self.text_encoder_2),
                                     ("clip", "clip_2")):
                hidden = enc(self._padded(ids.get(key, ids["clip"]), clip_len, tok).to(device),
                             output_hidden_states=True)
                pooled.append(hidden[0])
                embeds.append(hidden.hidden_states[-2].to(dtype=self.text_encoder.dtype, device=device))
            if self.text_encoder_3 is None:
                t5 = torch.zeros((1, max_sequence_length, self.transformer.config.joint_attention_dim),
                                 device=device, dtype=self.text_encoder.dtype)
            else:
                t5 = self.text_encoder_3(self._padded(ids["t5"], max_sequence_length, self.tokenizer_3).to(device))[0]
                t5 = t5.to(dtype=self.text_encoder_3.dtype, device=device)
            clip = torch.cat(embeds, dim=-1)
            clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
            prompt_embeds = torch.cat([clip, t5], dim=-2)
            pooled_embeds = torch.cat(pooled, dim=-1)
            prompt_ids = self._padded(ids["clip"], clip_len, self.tokenizer)[0].tolist()
            out.append(Conditioning({"prompt_embeds": prompt_embeds[0].float(),
                                     "pooled_prompt_embeds": pooled_embeds[0].float()}, prompt_ids))
        return out

    # ------------------------------------------------------------------ denoiser / decoder
    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 guidance=None, expert: int = 0) -> torch.Tensor:
        if latents.dim() != 4 or latents.shape[1] != self.transformer.config.in_channels:
            raise ValueError(
                f"latents must be [B, {self.transformer.config.in_channels}, h, w], got {tuple(latents.shape)}"
            )
        batch = latents.shape[0]
        if timesteps.dim() != 1 or timesteps.shape[0] != batch:
            raise ValueError(f"timesteps must be [B] = [{batch}], got {tuple(timesteps.shape)}")
        for key in ("prompt_embeds", "pooled_prompt_embeds"):
            if key not in cond:
                raise ValueError(f"cond is missing {key!r} (has {sorted(cond)})")
            if cond[key].shape[0] != batch:
                raise ValueError(f"cond[{key!r}] batch {cond[key].shape[0]} != latents batch {batch}")
        device, dtype = self.device, self.dtype
        out = self.transformer(
            hidden_states=latents.to(device=device, dtype=dtype),
            timestep=timesteps.to(device=device, dtype=torch.float32),  # embedded in fp32, like the pipeline
            encoder_hidden_states=cond["prompt_embeds"].to(device=device, dtype=dtype),
            pooled_projections=cond["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        vae_device = next(vae.parameters()).device
        z = latents.to(device=vae_device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z, return_dict=False)[0].float()

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        x = pixels.to(device=next(vae.parameters()).device, dtype=vae.dtype)
        z = vae.encode(x).latent_dist.mean
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()

    # ------------------------------------------------------------------ shapes / schedule
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        self.check_num_frames(num_frames)
        self.limits.check(height, width)
        f = self.vae_scale_factor
        return (int(self.vae.config.latent_channels), height // f, width // f)

    def sigmas(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """`FlowMatchEulerDiscreteScheduler.set_timesteps(T)` sigmas (with SD3's dynamic-shift `mu` if enabled)."""
        if not isinstance(num_inference_steps, int) or isinstance(num_inference_steps, bool) \
                or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}")
        self.limits.check(height, width)
        key = (num_inference_steps, height, width)
        if key not in self._sigma_cache:
            from diffusers import FlowMatchEulerDiscreteScheduler
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
            kwargs = {}
            if scheduler.config.get("use_dynamic_shifting", None):
                f = self.vae_scale_factor * self.patch_size
                image_seq_len = (height // f) * (width // f)
                kwargs["mu"] = calculate_shift(
                    image_seq_len,
                    scheduler.config.get("base_image_seq_len", 256),
                    scheduler.config.get("max_image_seq_len", 4096),
                    scheduler.config.get("base_shift", 0.5),
                    scheduler.config.get("max_shift", 1.16),
                )
            scheduler.set_timesteps(num_inference_steps, device="cpu", **kwargs)
            sig = scheduler.sigmas.detach().to(torch.float32).cpu()
            if sig.shape != (num_inference_steps + 1,):
                raise ValueError(f"scheduler returned {tuple(sig.shape)} sigmas for {num_inference_steps} steps")
            self._sigma_cache[key] = sig
        return self._sigma_cache[key].clone()
