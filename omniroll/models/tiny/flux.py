"""A tiny random FLUX.1 checkpoint (guidance-distilled, like FLUX.1-dev): CLIP + T5 text encoders, 16-channel VAE,
2x2-packed latents, dynamic-shift scheduler. Sizes follow diffusers' `tests/pipelines/flux` (wider VAE so that
latents are 4-channel and 2x downsampled, like the real model's layout)."""

from __future__ import annotations

from omniroll.models.tiny._common import (build_once, build_t5_tokenizer, check_seed, make_marker, seeded,
                                          train_clip_tokenizer)

COMPONENTS = ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


def build_tiny_flux(path: str, seed: int = 0) -> str:
    """Write (once) a random FLUX.1 checkpoint to `path`; returns `path`."""
    check_seed(seed)
    return build_once(path, make_marker(seed, "tiny", {}, "flux"), COMPONENTS, lambda: _pipeline(seed))


def _pipeline(seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = train_clip_tokenizer(), build_t5_tokenizer()
    clip = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=4,
                          num_hidden_layers=2, projection_dim=32, max_position_embeddings=77, hidden_act="gelu",
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    t5 = T5Config(vocab_size=len(tokenizer_2), d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2,
                  relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                  use_cache=False, pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
                  decoder_start_token_id=0)
    transformer = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                       guidance_embeds=True, axes_dims_rope=(4, 4, 8))
    vae = dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
               down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
               latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
               shift_factor=0.0609, scaling_factor=1.5035)
    return FluxPipeline(
        transformer=seeded(seed, 0, lambda: FluxTransformer2DModel(**transformer)),
        vae=seeded(seed, 1, lambda: AutoencoderKL(**vae)),
        text_encoder=seeded(seed, 2, lambda: CLIPTextModel(clip)),
        text_encoder_2=seeded(seed, 3, lambda: T5EncoderModel(t5)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096),
    )
