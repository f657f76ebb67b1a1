"""The shapes model's VAE: a small diffusers `AutoencoderKL` trained from scratch on pictures of the world.

Loss: L1 + MSE of the reconstruction (from a posterior sample) + `kl_weight` x KL. Trained on random `crop` x `crop`
windows of whole pictures (the network is convolutional, so a crop costs a quarter of a whole picture at half the
side and teaches the same edges). After training, `latent_stats` sets diffusers' `shift_factor` and `scaling_factor`
so that the transformer sees latents of mean 0 and standard deviation 1, as SD3's do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from omniroll.models.shapes.data import CaptionedScenes, to_unit_range


@dataclass(frozen=True)
class VaeRecipe:
    block_out_channels: tuple[int, ...] = (16, 32, 64)
    latent_channels: int = 4
    norm_num_groups: int = 8
    steps: int = 2000
    batch_size: int = 32
    crop: int = 32
    lr: float = 2e-3
    warmup_steps: int = 100
    kl_weight: float = 1e-6
    cosine_decay: bool = True
    seed: int = 1

    @property
    def scale_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


def build_vae(recipe: VaeRecipe, sample_size: int):
    """A fresh `AutoencoderKL` of the recipe's shape, weights drawn from `recipe.seed`."""
    from diffusers import AutoencoderKL

    n = len(recipe.block_out_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(recipe.block_out_channels),
            layers_per_block=1, latent_channels=recipe.latent_channels, norm_num_groups=recipe.norm_num_groups,
            sample_size=sample_size, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
            scaling_factor=1.0, shift_factor=0.0)


def lr_at(step: int, recipe) -> float:
    """Linear warm-up to `lr`, then (`recipe.cosine_decay`) cosine decay to a tenth of it at the last step, or
    constant (so that a run of N steps is exactly the first N steps of a longer one)."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    if not recipe.cosine_decay:
        return recipe.lr
    frac = (step - recipe.warmup_steps) / max(recipe.steps - recipe.warmup_steps, 1)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_vae(vae, recipe: VaeRecipe, data: CaptionedScenes,
              on_step: Optional[Callable[[int, dict], None]] = None) -> list[dict]:
    """Train `vae` in place for `recipe.steps` steps; returns one record per step (loss, L1, KL, seconds). Seeds
    torch's global generator (the posterior samples come from it): the run is deterministic for a thread count."""
    opt = torch.optim.AdamW(vae.parameters(), lr=recipe.lr, weight_decay=0.0)
    crop_rng = np.random.default_rng(recipe.seed + 7)
    torch.manual_seed(recipe.seed + 13)  # diffusers draws the posterior samples from torch's global generator
    history = []
    vae.train()
    t0 = time.time()
    for step in range(recipe.steps):
        _, pics = data.batch(recipe.batch_size)
        if recipe.crop < pics.shape[1]:
            off = crop_rng.integers(0, pics.shape[1] - recipe.crop + 1, size=2)
            off -= off % recipe.scale_factor  # aligned with the latent grid
            pics = pics[:, off[0]:off[0] + recipe.crop, off[1]:off[1] + recipe.crop]
        x = to_unit_range(np.ascontiguousarray(pics))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, recipe)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        l1 = (rec - x).abs().mean()
        mse = (rec - x).pow(2).mean()
        kl = post.kl().mean()
        loss = l1 + mse + recipe.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        rec_ = {"step": step + 1, "loss": loss.item(), "l1": l1.item(), "kl": kl.item(), "seconds": time.time() - t0}
        history.append(rec_)
        if on_step is not None:
            on_step(step + 1, rec_)
    vae.eval()
    return history


@torch.no_grad()
def latent_stats(vae, pictures: np.ndarray, batch_size: int = 128) -> tuple[float, float]:
    """(shift_factor, scaling_factor): the mean and 1 / std of posterior-mean latents of `pictures`."""
    zs = [vae.encode(to_unit_range(pictures[i:i + batch_size])).latent_dist.mean
          for i in range(0, len(pictures), batch_size)]
    z = torch.cat(zs).double()
    return float(z.mean()), float(1.0 / z.std())


@torch.no_grad()
def reconstruct(vae, pictures: np.ndarray, batch_size: int = 128) -> np.ndarray:
    """uint8 [n, H, W, 3]: pictures through the posterior mean and the decoder."""
    out = []
    for i in range(0, len(pictures), batch_size):
        z = vae.encode(to_unit_range(pictures[i:i + batch_size])).latent_dist.mean
        x = vae.decode(z).sample
        out.append(((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy())
    return np.concatenate(out)
