"""Tiny random Wan checkpoints: Wan 2.1 text-to-video and Wan 2.2 A14B (two transformers, the high-noise
`transformer` above `boundary_ratio`, the low-noise `transformer_2` below). UMT5 text encoder with a T5 tokenizer
built in memory, `AutoencoderKLWan` (8x spatial, 4x temporal), sizes from diffusers' `tests/pipelines/wan`.

The real checkpoints ship a UniPC scheduler config; omniroll steps with Euler / SDE (Flow-GRPO's sampler) on the
flow-shifted sigmas, so the tiny builds carry a `FlowMatchEulerDiscreteScheduler` with the same shift, which
diffusers' WanPipeline also accepts (the parity tests run it)."""

from __future__ import annotations

from omniroll.models.tiny._common import build_once, build_t5_tokenizer, check_seed, make_marker, seeded

COMPONENTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                   out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def build_tiny_wan(path: str, seed: int = 0) -> str:
    """Write (once) a random Wan 2.1 T2V checkpoint to `path`; returns `path`."""
    check_seed(seed)
    return build_once(path, make_marker(seed, "tiny", {}, "wan"), COMPONENTS, lambda: _pipeline(seed, False))


def build_tiny_wan22(path: str, seed: int = 0) -> str:
    """Write (once) a random Wan 2.2 A14B-style checkpoint (two transformers, boundary_ratio 0.875)."""
    check_seed(seed)
    return build_once(path, make_marker(seed, "tiny", {}, "wan2.2"), COMPONENTS + ("transformer_2",),
                      lambda: _pipeline(seed, True))


def _pipeline(seed: int, two_experts: bool):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_t5_tokenizer()
    umt5 = UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2,
                      relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                      use_cache=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      decoder_start_token_id=0)
    vae = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    return WanPipeline(
        transformer=seeded(seed, 0, lambda: WanTransformer3DModel(**TRANSFORMER)),
        transformer_2=seeded(seed, 4, lambda: WanTransformer3DModel(**TRANSFORMER)) if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,
        vae=seeded(seed, 1, lambda: AutoencoderKLWan(**vae)),
        text_encoder=seeded(seed, 2, lambda: UMT5EncoderModel(umt5)),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0 if two_experts else 5.0),
    )
