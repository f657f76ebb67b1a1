"""Deterministic random SD3 checkpoints, built offline (tests, demos, benchmarks).

`build_tiny_sd3(path, seed)` writes a directory laid out like a real diffusers SD3 repo (so that
`StableDiffusion3Pipeline.from_pretrained(path)` loads it): random fp32 weights (safetensors) drawn from `seed`, and
tokenizers trained in memory on a built-in word list. Same seed and preset give byte-identical weight files.
"""

from __future__ import annotations

import copy

from omniroll.models.tiny._common import (build_t5_tokenizer, build_once, check_seed, make_marker, seeded,
                                          train_clip_tokenizer)

COMPONENTS = (
    "transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3",
    "tokenizer", "tokenizer_2", "tokenizer_3",
)

# --------------------------------------------------------------------------- configs
PRESETS: dict[str, dict] = {
    "tiny": {
        "transformer": dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                            attention_head_dim=8, num_attention_heads=4, pos_embed_max_size=64),
        "vae": dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=4),
        "clip": dict(hidden_size=16, intermediate_size=32, projection_dim=32, num_hidden_layers=2,
                     num_attention_heads=2),
        "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8),
    },
    "bench": {
        "transformer": dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=4,
                            attention_head_dim=64, num_attention_heads=4, pos_embed_max_size=96),
        "vae": dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=32),
        "clip": dict(hidden_size=64, intermediate_size=128, projection_dim=64, num_hidden_layers=2,
                     num_attention_heads=4),
        "t5": dict(d_model=256, d_kv=64, d_ff=512, num_layers=2, num_heads=4, relative_attention_num_buckets=32),
    },
}
_GROUPS = ("transformer", "vae", "clip", "t5")
_DERIVED = ("caption_projection_dim", "pooled_projection_dim", "joint_attention_dim")


def resolve_config(preset: str = "tiny", **overrides) -> dict:
    """The preset's component configs with `overrides` applied.

    An override named after a group (`transformer`, `vae`, `clip`, `t5`) must be a dict merged into that group; any
    other key is a transformer field (e.g. `num_layers=6`). The transformer's caption_projection_dim,
    pooled_projection_dim and joint_attention_dim are derived from the other components and cannot be overridden.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = copy.deepcopy(PRESETS[preset])
    for key, value in overrides.items():
        if key in _GROUPS:
            if not isinstance(value, dict):
                raise ValueError(f"override {key!r} must be a dict of {key} config fields, got {type(value).__name__}")
            cfg[key].update(value)
        elif key in _DERIVED:
            raise ValueError(f"override {key!r} is derived from the text encoders / heads and cannot be set")
        else:
            cfg["transformer"][key] = value
    import inspect

    from diffusers import SD3Transformer2DModel

    params = set(inspect.signature(SD3Transformer2DModel.__init__).parameters) - {"self", *_DERIVED}
    bad = sorted(set(cfg["transformer"]) - params)
    if bad:
        raise ValueError(f"unknown SD3Transformer2DModel override(s) {bad}; allowed: {sorted(params)}")
    tr = cfg["transformer"]
    tr["caption_projection_dim"] = tr["num_attention_heads"] * tr["attention_head_dim"]
    tr["pooled_projection_dim"] = 2 * cfg["clip"]["projection_dim"]
    tr["joint_attention_dim"] = cfg["t5"]["d_model"]
    return cfg


# --------------------------------------------------------------------------- builder
def build_tiny_sd3(path: str, seed: int = 0, preset: str = "tiny", **overrides) -> str:
    """Write a random SD3 checkpoint to `path` (created if missing) and return `path`.

    Idempotent: if `path` already holds a complete checkpoint built with the same seed / preset / overrides (see the
    `omniroll_tiny.json` marker), it is returned untouched.
    """
    check_seed(seed)
    cfg = resolve_config(preset, **overrides)
    return build_once(path, make_marker(seed, preset, overrides), COMPONENTS, lambda: _pipeline(seed, cfg))


def _pipeline(seed: int, cfg: dict):
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = train_clip_tokenizer()
    tokenizer_2 = train_clip_tokenizer()
    tokenizer_3 = build_t5_tokenizer()

    def clip(index: int):
        c = cfg["clip"]
        conf = CLIPTextConfig(
            vocab_size=len(tokenizer), max_position_embeddings=77, hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **c,
        )
        return seeded(seed, index, lambda: CLIPTextModelWithProjection(conf))

    t5_conf = T5Config(
        vocab_size=len(tokenizer_3), feed_forward_proj="gated-gelu", relative_attention_max_distance=128,
        pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id, decoder_start_token_id=0,
        is_encoder_decoder=False, use_cache=False, **cfg["t5"],
    )
    vae_cfg = dict(cfg["vae"])
    n_blocks = len(vae_cfg["block_out_channels"])
    vae_cfg.setdefault("down_block_types", ("DownEncoderBlock2D",) * n_blocks)
    vae_cfg.setdefault("up_block_types", ("UpDecoderBlock2D",) * n_blocks)
    vae_cfg.setdefault("latent_channels", cfg["transformer"]["in_channels"])
    vae_cfg.setdefault("scaling_factor", 1.5305)
    vae_cfg.setdefault("shift_factor", 0.0609)
    vae_cfg.setdefault("use_quant_conv", False)
    vae_cfg.setdefault("use_post_quant_conv", False)
    vae_cfg.setdefault("sample_size", cfg["transformer"]["sample_size"] * 2 ** (n_blocks - 1))
    vae_cfg["block_out_channels"] = tuple(vae_cfg["block_out_channels"])

    return StableDiffusion3Pipeline(
        transformer=seeded(seed, 0, lambda: SD3Transformer2DModel(**cfg["transformer"])),
        vae=seeded(seed, 1, lambda: AutoencoderKL(**vae_cfg)),
        text_encoder=clip(2),
        text_encoder_2=clip(3),
        text_encoder_3=seeded(seed, 4, lambda: T5EncoderModel(t5_conf)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )
