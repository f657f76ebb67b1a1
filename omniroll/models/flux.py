"""FLUX.1 adapter: diffusers' `FluxPipeline` components and helpers (prompt encoding, 2x2 latent packing, latent
ids, dynamic-shift sigmas), the engine's denoise loop.

Guidance-distilled: `guidance_scale` is an input of the transformer (FLUX.1-dev embeds it; a checkpoint without
`guidance_embeds`, like FLUX.1-schnell, ignores it), so a request runs one row. `true_cfg_scale` > 1 adds real CFG
on top (an unconditional row from `negative_prompt`, default ""), as diffusers' `true_cfg_scale`.
Latents are kept unpacked ([C, h, w]); `velocity` packs them for the transformer and unpacks its output (a pure
permutation), so trajectories have the same layout as SD3's.
"""

from __future__ import annotations

import torch

from omniroll.models._flow import PackedLatentAdapter
from omniroll.models.base import Conditioning
from omniroll.models.checkpoint import (DEFAULT_MAX_SEQUENCE_LENGTH, ModelLimits, read_component_configs,
                                        tokenizer_padded_length)


class FluxAdapter(PackedLatentAdapter):
    pipeline_class = "FluxPipeline"
    guidance_kind = "distilled"
    #: both streams' attention projections (the double blocks; the single blocks' to_q / to_k / to_v match too).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

    family = "FLUX"
    components = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")

    def __init__(self, pipeline):
        self._adopt(pipeline)
        self.transformer = pipeline.transformer
        self._eval_mode()
        self._img_ids: dict[tuple, torch.Tensor] = {}

    @classmethod
    def limits_from_files(cls, path: str) -> ModelLimits:
        (vae,) = read_component_configs(path, "vae")
        mult = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1) * 2
        return ModelLimits(mult, None, DEFAULT_MAX_SEQUENCE_LENGTH)

    @classmethod
    def prompt_ids_length(cls, path: str) -> int | None:
        """CLIP's `model_max_length`: `encode_prompts` pads the reported ids to it."""
        return tokenizer_padded_length(path)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def spatial_multiple(self) -> int:
        return self.vae_scale_factor * 2  # 2x2 packing

    def modules(self) -> dict[str, torch.nn.Module]:
        p = self.pipeline
        return {"transformer": p.transformer, "vae": p.vae, "text_encoder": p.text_encoder,
                "text_encoder_2": p.text_encoder_2}

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning]:
        """CLIP pooled + T5 sequence embeddings per prompt, via diffusers' `encode_prompt`, one prompt at a time."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        self.limits.check(max_sequence_length=max_sequence_length)
        device = next(self.pipeline.text_encoder_2.parameters()).device
        out = {}
        for prompt in dict.fromkeys(prompts):
            embeds, pooled, _ = self.pipeline.encode_prompt(prompt=[prompt], prompt_2=None, device=device,
                                                            max_sequence_length=max_sequence_length)
            ids = self.pipeline.tokenizer(prompt, padding="max_length", truncation=True,
                                          max_length=self.pipeline.tokenizer_max_length).input_ids
            out[prompt] = ({"prompt_embeds": embeds[0].float(), "pooled_prompt_embeds": pooled[0].float()}, ids)
        return [Conditioning({k: v.clone() for k, v in out[p][0].items()}, [int(i) for i in out[p][1]])
                for p in prompts]

    # ------------------------------------------------------------------ denoiser / decoder
    def velocity(self, latents, timesteps, cond, guidance=None, expert: int = 0) -> torch.Tensor:
        from diffusers import FluxPipeline

        B, C, h, w = latents.shape
        device, dtype = self.device, self.dtype
        packed = FluxPipeline._pack_latents(latents, B, C, h, w)
        key = (h, w, device, dtype)  # built on the host by diffusers: copy it to the device once per shape
        if key not in self._img_ids:
            self._img_ids[key] = FluxPipeline._prepare_latent_image_ids(B, h // 2, w // 2, device, dtype)
        img_ids = self._img_ids[key]
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=device, dtype=dtype)
        if self.transformer.config.guidance_embeds:
            if guidance is None:
                raise ValueError("FLUX with guidance_embeds needs a per-row guidance [B]")
            guidance = guidance.to(device=device, dtype=torch.float32)
        else:
            guidance = None
        out = self.transformer(
            hidden_states=packed.to(device=device, dtype=dtype),
            timestep=(timesteps.to(device=device, dtype=dtype) / 1000),
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(device=device, dtype=dtype),
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]
        f = self.vae_scale_factor
        return FluxPipeline._unpack_latents(out, h * f, w * f, f).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        z = latents.to(device=next(vae.parameters()).device, dtype=vae.dtype)
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z, return_dict=False)[0].float()
