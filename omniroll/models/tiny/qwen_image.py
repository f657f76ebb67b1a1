"""A tiny random Qwen-Image checkpoint: a Qwen2.5-VL text encoder with a byte-level BPE tokenizer trained in
memory (its chat template therefore tokenizes to another length than the real one's 34 dropped tokens; the
adapter computes the count from the tokenizer), the Qwen-Image video-style VAE and transformer, sized after
diffusers' `tests/pipelines/qwenimage`."""

from __future__ import annotations

from omniroll.models.tiny._common import build_once, check_seed, make_marker, seeded, train_qwen2_tokenizer

COMPONENTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")


def build_tiny_qwen_image(path: str, seed: int = 0) -> str:
    """Write (once) a random Qwen-Image checkpoint to `path`; returns `path`."""
    check_seed(seed)
    return build_once(path, make_marker(seed, "tiny", {}, "qwen-image"), COMPONENTS, lambda: _pipeline(seed))


def _pipeline(seed: int):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = train_qwen2_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                           "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    vocab = len(tokenizer)
    text = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=vocab, rope_theta=1e6, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"],
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        vocab_size=vocab, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    transformer = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                       num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    vae = dict(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
               latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0])
    return QwenImagePipeline(
        transformer=seeded(seed, 0, lambda: QwenImageTransformer2DModel(**transformer)),
        vae=seeded(seed, 1, lambda: AutoencoderKLQwenImage(**vae)),
        text_encoder=seeded(seed, 2, lambda: Qwen2_5_VLForConditionalGeneration(text)),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"),
    )
