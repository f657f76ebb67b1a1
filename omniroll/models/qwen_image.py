"""Qwen-Image adapter: diffusers' `QwenImagePipeline` components and helpers (Qwen2.5-VL prompt encoding with its
chat template, 2x2 latent packing, dynamic-shift sigmas), the engine's denoise loop.

CFG is real ("true") CFG with diffusers' norm rescale: comb = u + s (c - u), then rescaled so each packed token keeps
the conditional prediction's norm. `guidance_scale` is that scale (diffusers calls it `true_cfg_scale`); > 1 adds
an unconditional row from `negative_prompt` (default "").
The pipeline drops the chat template's system prefix from the text encoder's hidden states by a fixed count (34,
right for the released tokenizer only); the adapter computes that count from the tokenizer it actually loaded.
Prompt embeddings are padded to `max_sequence_length` with a mask (`prompt_embeds_mask`, 1 = real token) so rows of
different prompt lengths share a forward; the transformer masks the padding out of attention.
"""

from __future__ import annotations

import torch

from omniroll.models._flow import PackedLatentAdapter
from omniroll.models.base import Conditioning
from omniroll.models.checkpoint import DEFAULT_MAX_SEQUENCE_LENGTH, ModelLimits, read_component_configs


def template_drop_count(tokenizer, template: str) -> int:
    """How many tokens of `template` precede the prompt, with this tokenizer (checked on a probe prompt)."""
    prefix = template.split("{}")[0]
    ids = tokenizer(prefix).input_ids
    probe = tokenizer(template.format("a photo")).input_ids
    if probe[:len(ids)] != ids:
        raise ValueError("the tokenizer merges the prompt template's prefix with the prompt; cannot drop it exactly")
    return len(ids)


class QwenImageAdapter(PackedLatentAdapter):
    pipeline_class = "QwenImagePipeline"
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

    family = "Qwen-Image"
    components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

    def __init__(self, pipeline):
        self._adopt(pipeline)
        self.transformer = pipeline.transformer
        pipeline.prompt_template_encode_start_idx = template_drop_count(pipeline.tokenizer,
                                                                        pipeline.prompt_template_encode)
        self._eval_mode()

    @classmethod
    def limits_from_files(cls, path: str) -> ModelLimits:
        (vae,) = read_component_configs(path, "vae")
        return ModelLimits(2 ** len(vae.get("temperal_downsample", [False, True, True])) * 2, None,
                           DEFAULT_MAX_SEQUENCE_LENGTH)

    @property
    def template_drop_count(self) -> int:
        return self.pipeline.prompt_template_encode_start_idx

    @property
    def vae_scale_factor(self) -> int:
        return self.pipeline.vae_scale_factor

    @property
    def spatial_multiple(self) -> int:
        return self.vae_scale_factor * 2  # 2x2 packing

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer, "vae": self.vae, "text_encoder": self.pipeline.text_encoder}

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning]:
        """Per prompt: hidden states after the template prefix, zero-padded to `max_sequence_length`, and a mask."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        self.limits.check(max_sequence_length=max_sequence_length)
        device = next(self.pipeline.text_encoder.parameters()).device
        out = {}
        for prompt in dict.fromkeys(prompts):
            embeds, _ = self.pipeline.encode_prompt(prompt=[prompt], device=device,
                                                    max_sequence_length=max_sequence_length)
            n, dim = embeds.shape[1], embeds.shape[2]
            padded = embeds.new_zeros(max_sequence_length, dim)
            padded[:n] = embeds[0]
            mask = torch.zeros(max_sequence_length, dtype=torch.long, device=embeds.device)
            mask[:n] = 1
            ids = self.pipeline.tokenizer(self.pipeline.prompt_template_encode.format(prompt)).input_ids
            ids = ids[self.template_drop_count:][:max_sequence_length]
            out[prompt] = ({"prompt_embeds": padded.float(), "prompt_embeds_mask": mask}, ids)
        return [Conditioning({k: v.clone() for k, v in out[p][0].items()}, [int(i) for i in out[p][1]])
                for p in prompts]

    # ------------------------------------------------------------------ packing
    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        B, C, h, w = latents.shape
        return self.pipeline._pack_latents(latents, B, C, h, w)

    def _unpack(self, packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
        f = self.vae_scale_factor
        return self.pipeline._unpack_latents(packed, h * f, w * f, f)[:, :, 0]  # [B, C, 1, h, w] -> [B, C, h, w]

    # ------------------------------------------------------------------ denoiser / decoder / CFG
    def velocity(self, latents, timesteps, cond, guidance=None, expert: int = 0) -> torch.Tensor:
        B, C, h, w = latents.shape
        device, dtype = self.device, self.dtype
        out = self.transformer(
            hidden_states=self._pack(latents).to(device=device, dtype=dtype),
            timestep=timesteps.to(device=device, dtype=dtype) / 1000,
            guidance=None,
            encoder_hidden_states=cond["prompt_embeds"].to(device=device, dtype=dtype),
            encoder_hidden_states_mask=cond["prompt_embeds_mask"].to(device=device),
            img_shapes=[[(1, h // 2, w // 2)]] * B,
            return_dict=False,
        )[0]
        return self._unpack(out.float(), h, w)

    def mix_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """diffusers' true CFG with norm rescale, on the packed tokens (norm over each token's channels)."""
        h, w = cond.shape[-2:]
        c, u = self._pack(cond[None]), self._pack(uncond[None])
        comb = u + scale * (c - u)
        comb = comb * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        return self._unpack(comb, h, w)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        z = latents.to(device=next(vae.parameters()).device, dtype=vae.dtype)[:, :, None]  # one frame
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(z.device, z.dtype)
        return vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0].float()
