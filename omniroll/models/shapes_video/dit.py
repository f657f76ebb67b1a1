"""The shapes-video model's transformer: diffusers' `WanTransformer3DModel` trained from scratch by rectified flow on
the world's clips (as normalised latents of the video VAE) and captions (as the frozen text encoder embeds them).

    x_t = (1 - t) x0 + t eps,   target eps - x0,   t = sigmoid(n), n ~ N(0, 1) (logit-normal)

The batch draw, the optimizer step and the EMA are the shapes model's (`omniroll.models.shapes.dit`). The patch is
(1, 2, 2): every latent frame keeps its own tokens (a temporal patch of 3 made motion stepped in the measured
experiment: ../shared/reference/video_experiment.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniroll.models.shapes.dit import noised_batch


@dataclass(frozen=True)
class VideoDitRecipe:
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    ffn_dim: int = 512
    freq_dim: int = 64
    steps: int = 6000
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 200
    cosine_decay: bool = False  # constant after warm-up: N steps are the first N steps of any longer run
    weight_decay: float = 0.0
    cfg_dropout: float = 0.1
    ema_decay: float = 0.999
    num_latents: int = 6000
    seed: int = 3


#: the patch: one latent frame, 2 x 2 latent pixels (never merge frames)
PATCH_SIZE = (1, 2, 2)


def build_transformer(recipe: VideoDitRecipe, latent_channels: int, text_dim: int):
    """A fresh `WanTransformer3DModel` of the recipe's shape (weights from `recipe.seed`)."""
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return WanTransformer3DModel(
            patch_size=PATCH_SIZE, num_attention_heads=recipe.num_heads, attention_head_dim=recipe.head_dim,
            in_channels=latent_channels, out_channels=latent_channels, text_dim=text_dim,
            freq_dim=recipe.freq_dim, ffn_dim=recipe.ffn_dim, num_layers=recipe.num_layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def flow_loss(transformer, recipe: VideoDitRecipe, latents: torch.Tensor, caption_ids: torch.Tensor,
              prompt_embeds: torch.Tensor, empty: int, g: torch.Generator) -> torch.Tensor:
    """The rectified-flow loss of one batch drawn with `g`: latents [N, C, t, h, w] (normalised), caption_ids [N]
    into prompt_embeds [P, L, D], `empty` the empty prompt's index (CFG dropout)."""
    b = noised_batch(latents, caption_ids, recipe.batch_size, recipe.cfg_dropout, empty, g)
    v = transformer(hidden_states=b.x_t, timestep=b.t * 1000, encoder_hidden_states=prompt_embeds[b.cap],
                    return_dict=False)[0]
    return (v - (b.eps - b.x0)).pow(2).mean()
