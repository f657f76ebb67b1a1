"""Wan adapter (2.1 text-to-video and 2.2 A14B): diffusers' `WanPipeline` components and helpers (UMT5 prompt
encoding, latent layout, VAE normalisation), the engine's denoise loop. Video latents are [C, t, h, w] with
t = (num_frames - 1) / 4 + 1; decode gives [B, T, 3, H, W].

Wan 2.2 A14B has two transformers: `transformer` (high noise) runs while the timestep is >= boundary_ratio x 1000,
`transformer_2` (low noise) after. The engine keeps rows of the two experts in separate forwards and records each
recorded step's expert in the trajectory (`expert_indices`), so a trainer replays the same switch. Weight sync
targets both: the denoiser is a ModuleDict {"transformer", "transformer_2"} (LoRA / weight keys start with the
expert's name); Wan 2.1's denoiser is the transformer itself.

Sampling: the engine steps Euler / SDE on the flow-shifted sigmas of a `FlowMatchEulerDiscreteScheduler` (the
checkpoint's own if it ships one; for UniPC configs, one with the same `flow_shift`): the Flow-GRPO sampler, not
UniPC's multistep solver.
"""

from __future__ import annotations

import torch

from omniroll.models.base import Conditioning, DiffusionAdapter, check_int
from omniroll.models.checkpoint import ModelLimits, read_component_configs, tokenizer_max_length


class WanAdapter(DiffusionAdapter):
    pipeline_class = "WanPipeline"
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")

    family = "Wan"
    components = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

    def __init__(self, pipeline):
        self._adopt(pipeline)
        if pipeline.config.get("expand_timesteps", False):
            raise ValueError("Wan 2.2 TI2V (expand_timesteps=True) is not supported yet")
        self.experts = [pipeline.transformer]
        self.boundary_ratio = pipeline.config.get("boundary_ratio", None)
        if self.boundary_ratio is not None:
            if pipeline.transformer_2 is None:
                raise ValueError("Wan checkpoint has boundary_ratio but no transformer_2")
            self.experts.append(pipeline.transformer_2)
            self._denoiser = torch.nn.ModuleDict({"transformer": pipeline.transformer,
                                                  "transformer_2": pipeline.transformer_2})
        else:
            self._denoiser = pipeline.transformer
        self.num_experts = len(self.experts)
        self.scheduler_class = type(pipeline.scheduler).__name__
        self._eval_mode()

    @classmethod
    def limits_from_files(cls, path: str) -> ModelLimits:
        vae, transformer, text = read_component_configs(path, "vae", "transformer", "text_encoder")
        mult = int(vae.get("scale_factor_spatial", 8)) * int(transformer.get("patch_size", [1, 2, 2])[1])
        return ModelLimits(mult, None, text_length_limit(text))

    @property
    def max_sequence_length_limit(self) -> int:
        return text_length_limit(self.pipeline.text_encoder.config.to_dict())

    @property
    def transformer(self):
        return self.experts[0]

    @property
    def is_video(self) -> bool:
        return True

    @property
    def spatial_multiple(self) -> int:
        return self.pipeline.vae_scale_factor_spatial * self.transformer.config.patch_size[1]

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self._denoiser, "vae": self.vae, "text_encoder": self.pipeline.text_encoder}

    def check_num_frames(self, num_frames: int) -> None:
        k = self.pipeline.vae_scale_factor_temporal
        if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"num_frames must be {k}k + 1 (1, {k + 1}, {2 * k + 1}, ...) for Wan, got {num_frames!r}")

    def expert_index(self, timestep: float) -> int:
        if self.boundary_ratio is None:
            return 0
        boundary = self.boundary_ratio * self.scheduler_config.get("num_train_timesteps", 1000)
        return 0 if timestep >= boundary else 1

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning]:
        """The text encoder's embeddings per prompt (Wan's UMT5, or any encoder whose output has
        `last_hidden_state`), via diffusers' `encode_prompt` (padded to max_sequence_length with zeros)."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        self.limits.check(max_sequence_length=max_sequence_length)
        device = next(self.pipeline.text_encoder.parameters()).device
        out = {}
        for prompt in dict.fromkeys(prompts):
            embeds, _ = self.pipeline.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False,
                                                    max_sequence_length=max_sequence_length, device=device)
            ids = self.pipeline.tokenizer(prompt, padding="max_length", truncation=True,
                                          max_length=max_sequence_length).input_ids
            out[prompt] = (embeds[0].float(), ids)
        return [Conditioning({"prompt_embeds": out[p][0].clone()}, [int(i) for i in out[p][1]]) for p in prompts]

    # ------------------------------------------------------------------ denoiser / decoder
    def velocity(self, latents, timesteps, cond, guidance=None, expert: int = 0) -> torch.Tensor:
        model = self.experts[expert]
        param = next(model.parameters())
        return model(
            hidden_states=latents.to(device=param.device, dtype=param.dtype),
            timestep=timesteps.to(device=param.device, dtype=torch.float32),
            encoder_hidden_states=cond["prompt_embeds"].to(device=param.device, dtype=param.dtype),
            return_dict=False,
        )[0].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        z = latents.to(device=next(vae.parameters()).device, dtype=vae.dtype)
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(z.device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # [B, 3, T, H, W]
        return video.permute(0, 2, 1, 3, 4).float()

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        x = pixels.permute(0, 2, 1, 3, 4).to(device=next(vae.parameters()).device, dtype=vae.dtype)  # [B, 3, T, H, W]
        z = vae.encode(x).latent_dist.mean
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(view).to(z.device, z.dtype)
        return ((z - mean) / std).float()

    # ------------------------------------------------------------------ shapes / schedule
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        self.check_num_frames(num_frames)
        self.limits.check(height, width)
        s, t = self.pipeline.vae_scale_factor_spatial, self.pipeline.vae_scale_factor_temporal
        return (self.vae.config.z_dim, (num_frames - 1) // t + 1, height // s, width // s)

    def sigmas(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """WanPipeline's `scheduler.set_timesteps(T)` sigmas (static flow shift; no resolution dependence)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        check_int("num_inference_steps", num_inference_steps, 1)
        self.latent_shape(height, width, num_frames)
        if num_inference_steps not in self._sigma_cache:
            cfg = self.scheduler_config
            if self.scheduler_class == "FlowMatchEulerDiscreteScheduler":
                scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
            else:  # UniPC (flow_prediction) configs: the same flow shift, stepped with Euler / SDE
                scheduler = FlowMatchEulerDiscreteScheduler(
                    num_train_timesteps=cfg.get("num_train_timesteps", 1000), shift=cfg.get("flow_shift", 1.0))
            scheduler.set_timesteps(num_inference_steps, device="cpu")
            self._sigma_cache[num_inference_steps] = scheduler.sigmas.detach().to(torch.float32).cpu()
        return self._sigma_cache[num_inference_steps].clone()


def text_length_limit(text_encoder_config: dict) -> int:
    """The longest text the encoder takes: its position embeddings' count where it has them (a BERT, as the
    shapes-video model's), else `DEFAULT_MAX_SEQUENCE_LENGTH` (Wan's UMT5 has relative positions only)."""
    return tokenizer_max_length(text_encoder_config.get("max_position_embeddings"))
