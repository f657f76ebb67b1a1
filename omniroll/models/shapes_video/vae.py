"""The shapes-video model's VAE: diffusers' `AutoencoderKLWan` at a small config, trained from scratch on clips of the
world, and the pieces its training needs.

Loss: L1 + MSE of the reconstruction (from a posterior sample) + `kl_weight` x KL, the reconstruction decoded by
`decode_unclamped` (diffusers' decode clamps its output to [-1, 1], so a pixel pushed past the range gets no gradient
back; measured in ../shared/reference/video_experiment.md: a 9-minute run with the clamp learned no shapes).

Curriculum: Wan's VAE is causal in time and encodes a clip's first frame alone (1 + 4k frames -> 1 + k latent frames),
so the first `image_steps` steps train on single frames (batches of `image_batch` pictures as one-frame clips: the
spatial path, cheaply), the next `clip_steps` on whole clips (`clip_batch` of them: the temporal path), and the last
`foreground_steps` on clips with object pixels weighted `foreground_weight` x in the reconstruction loss
(`pixel_weights`). Without that last phase the VAE loses the objects' colour after the first frame (a grey 14-18 px
object costs the mean loss little) and the checker passes 23.8 % of its reconstructions (docs/moving_shapes.md, "The
VAE check").
After training the latents are normalised per channel: the VAE config's `latents_mean` / `latents_std` (what the
Wan adapter and diffusers' `WanPipeline` read) are the posterior means' per-channel mean and standard deviation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omniroll.models.shapes_video.data import TrainingClips, to_clips, to_video_range


@dataclass(frozen=True)
class VideoVaeRecipe:
    base_dim: int = 16
    z_dim: int = 8
    dim_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 1
    temporal_downsample: tuple[bool, ...] = (True, True)  # one per spatial downsampling (len(dim_mult) - 1)
    image_steps: int = 1500
    clip_steps: int = 3000
    image_batch: int = 32
    clip_batch: int = 8
    lr: float = 2e-3
    warmup_steps: int = 100
    cosine_decay: bool = False  # constant after warm-up: N steps are the first N steps of any longer run
    kl_weight: float = 1e-6
    foreground_steps: int = 2000  # clip steps after the clip phase with object pixels weighted (0: none)
    foreground_weight: float = 10.0  # an object pixel's weight in those steps' L1 + MSE (background pixels: 1)
    foreground_threshold: float = 0.1  # a pixel is an object's when a channel is this far from the background ([-1, 1])
    seed: int = 1

    @property
    def steps(self) -> int:
        """Steps of the first phase (frames, then clips, the plain loss); the foreground steps come after."""
        return self.image_steps + self.clip_steps

    @property
    def scale_factor_spatial(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def scale_factor_temporal(self) -> int:
        return 2 ** sum(bool(t) for t in self.temporal_downsample)


def build_vae(recipe: VideoVaeRecipe):
    """A fresh `AutoencoderKLWan` of the recipe's shape, weights drawn from `recipe.seed`; latents_mean 0 and
    latents_std 1 until `set_latent_stats`."""
    from diffusers import AutoencoderKLWan

    if len(recipe.temporal_downsample) != len(recipe.dim_mult) - 1:
        raise ValueError(f"vae.temporal_downsample: one flag per downsampling, {len(recipe.dim_mult) - 1} for "
                         f"dim_mult {list(recipe.dim_mult)}, got {list(recipe.temporal_downsample)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return AutoencoderKLWan(
            base_dim=recipe.base_dim, z_dim=recipe.z_dim, dim_mult=list(recipe.dim_mult),
            num_res_blocks=recipe.num_res_blocks, temperal_downsample=list(recipe.temporal_downsample),
            latents_mean=[0.0] * recipe.z_dim, latents_std=[1.0] * recipe.z_dim,
            scale_factor_spatial=recipe.scale_factor_spatial, scale_factor_temporal=recipe.scale_factor_temporal)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W]: what `vae.decode(z).sample` gives before its final `clamp(-1, 1)` (so a training loss reaches
    every pixel). The same causal pass as diffusers' `AutoencoderKLWan._decode`: `post_quant_conv`, then the decoder
    one latent frame at a time (the first as the first chunk), the frames chained through the decoder's feature
    cache (a list of one slot per causal 3-D convolution, kept here rather than on the VAE). Untiled and without
    patchify: the recipe's VAE has no patch size (ValueError otherwise)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    if vae.config.patch_size is not None:
        raise ValueError(f"decode_unclamped: VAEs with a patch size are not supported, got {vae.config.patch_size}")
    cache = [None] * sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
    x = vae.post_quant_conv(z)
    frames = [vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
              for i in range(x.shape[2])]
    return torch.cat(frames, 2)


def vae_batch(data: TrainingClips, recipe: VideoVaeRecipe, data_seed: int, step: int) -> torch.Tensor:
    """Step `step`'s training input [B, 3, T, H, W]: single frames (T = 1) during the image steps, then clips."""
    if step < recipe.image_steps:
        _, clips = data.batch(data_seed, step, recipe.image_batch)
        frame = np.random.default_rng([data_seed, step, 1]).integers(clips.shape[1], size=len(clips))
        clips = clips[np.arange(len(clips)), frame][:, None]
    else:
        _, clips = data.batch(data_seed, step, recipe.clip_batch)
    return to_video_range(clips)


def pixel_weights(x: torch.Tensor, recipe: VideoVaeRecipe) -> torch.Tensor:
    """[B, 1, T, H, W]: `foreground_weight` where a pixel of clips `x` ([-1, 1]) is an object's (some channel more
    than `foreground_threshold` from the background, which fills every clip's top-left pixel), 1 elsewhere."""
    background = x[:, :, :, :1, :1]
    objects = (x - background).abs().amax(1, keepdim=True) > recipe.foreground_threshold
    return 1.0 + (recipe.foreground_weight - 1.0) * objects.to(x.dtype)


def vae_step(vae, x: torch.Tensor, recipe: VideoVaeRecipe, g: torch.Generator,
             foreground: bool = False) -> tuple[torch.Tensor, dict]:
    """(loss, its parts) of one batch: the posterior sampled with `g`, decoded without the clamp; with `foreground`
    the L1 + MSE is a mean weighted by `pixel_weights` (the weights summed over channels and pixels)."""
    post = vae.encode(x).latent_dist
    rec = decode_unclamped(vae, post.sample(generator=g))
    err = rec - x
    if foreground:
        w = pixel_weights(x, recipe)
        total = w.sum() * x.shape[1]
        l1, mse = (w * err.abs()).sum() / total, (w * err.pow(2)).sum() / total
    else:
        l1, mse = err.abs().mean(), err.pow(2).mean()
    kl = post.kl().mean()
    return l1 + mse + recipe.kl_weight * kl, {"l1": l1.item(), "kl": kl.item(), "frames": x.shape[2]}


@torch.no_grad()
def encode_means(vae, clips: np.ndarray, batch_size: int = 16) -> torch.Tensor:
    """Posterior means [n, z_dim, t, h, w] of uint8 clips [n, T, 3, H, W] (not normalised)."""
    return torch.cat([vae.encode(to_video_range(clips[i:i + batch_size])).latent_dist.mean
                      for i in range(0, len(clips), batch_size)])


def set_latent_stats(vae, means: torch.Tensor) -> tuple[list[float], list[float]]:
    """Put the per-channel mean and standard deviation of posterior means [N, C, t, h, w] in the VAE's config
    (`latents_mean`, `latents_std`); returns them."""
    z = means.double().transpose(0, 1).reshape(means.shape[1], -1)
    mean, std = z.mean(1).tolist(), z.std(1).tolist()
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return mean, std


def normalise(vae, means: torch.Tensor) -> torch.Tensor:
    """(means - latents_mean) / latents_std per channel, float32: what the transformer learns to draw."""
    view = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float64).view(view)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float64).view(view)
    return ((means.double() - mean) / std).float()


@torch.no_grad()
def reconstruct(vae, clips: np.ndarray, batch_size: int = 16) -> np.ndarray:
    """uint8 [n, T, 3, H, W]: clips through the posterior mean and diffusers' decode (clamped, as the pipeline
    decodes)."""
    out = []
    for i in range(0, len(clips), batch_size):
        z = vae.encode(to_video_range(clips[i:i + batch_size])).latent_dist.mean
        out.append(to_clips(vae.decode(z).sample))
    return np.concatenate(out)

