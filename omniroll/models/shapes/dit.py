"""The shapes model's transformer: a diffusers `SD3Transformer2DModel` trained from scratch by rectified flow on the
world's pictures (as latents of the shapes VAE) and captions (as the frozen text encoders embed them).

    x_t = (1 - t) x0 + t eps,   target eps - x0,   t = sigmoid(n), n ~ N(0, 1) (SD3's logit-normal)

`cfg_dropout` of the captions are replaced by the empty prompt, so classifier-free guidance works. The weights a
sampler should use are the exponential moving average (`ema_decay`, warmed up as (1 + n) / (10 + n)), kept beside
the trained ones. The model starts as adaLN-Zero (diffusers' default init for SD3: every block starts as the identity).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from omniroll.models.shapes.vae import lr_at


@dataclass(frozen=True)
class DitRecipe:
    patch_size: int = 2
    num_layers: int = 6
    num_heads: int = 4
    head_dim: int = 32
    steps: int = 4500
    batch_size: int = 128
    lr: float = 2e-3
    warmup_steps: int = 200
    cosine_decay: bool = False  # constant after warm-up: N steps are the first N steps of any longer run
    weight_decay: float = 0.0
    cfg_dropout: float = 0.1
    ema_decay: float = 0.999
    num_latents: int = 100_000
    seed: int = 3


def build_transformer(recipe: DitRecipe, latent_channels: int, latent_size: int, joint_dim: int, pooled_dim: int):
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return SD3Transformer2DModel(
            sample_size=latent_size, patch_size=recipe.patch_size, in_channels=latent_channels,
            out_channels=latent_channels, num_layers=recipe.num_layers, attention_head_dim=recipe.head_dim,
            num_attention_heads=recipe.num_heads, joint_attention_dim=joint_dim,
            caption_projection_dim=recipe.num_heads * recipe.head_dim, pooled_projection_dim=pooled_dim,
            pos_embed_max_size=latent_size // recipe.patch_size, qk_norm="rms_norm")


class EMA:
    """Exponential moving average of a module's parameters (decay warmed up as min(decay, (1 + n) / (10 + n)))."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.module = copy.deepcopy(module).eval().requires_grad_(False)
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for e, p in zip(self.module.parameters(), module.parameters()):
            e.lerp_(p.detach(), 1 - d)

    def state_dict(self) -> dict:
        """The averaged weights and the update count (what a resumed run needs to continue the average exactly)."""
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


@dataclass
class NoisedBatch:
    """A batch of the forward process: cap [B] caption ids (`drop` [B]: replaced by the empty prompt), t [B],
    x_t = (1 - t) x0 + t eps."""

    x0: torch.Tensor
    eps: torch.Tensor
    t: torch.Tensor
    x_t: torch.Tensor
    cap: torch.Tensor
    drop: torch.Tensor


def noised_batch(latents: torch.Tensor, caption_ids: torch.Tensor, batch_size: int, cfg_dropout: float, empty: int,
                 g: torch.Generator) -> NoisedBatch:
    """`batch_size` latents (any [N, C, ...]: pictures or video) drawn with `g`, `cfg_dropout` of their captions
    replaced by the empty prompt, noised at logit-normal t (drawn in this order: indices, dropout, t, eps)."""
    idx = torch.randint(len(latents), (batch_size,), generator=g)
    x0 = latents[idx]
    cap = caption_ids[idx].clone()
    drop = torch.rand(batch_size, generator=g) < cfg_dropout
    cap[drop] = empty
    t = torch.sigmoid(torch.randn(batch_size, generator=g))
    eps = torch.randn(x0.shape, generator=g)
    t_ = t.view(-1, *(1,) * (x0.dim() - 1))  # [B, 1, ...]: pictures [B, C, h, w] and video latents [B, C, t, h, w]
    x_t = (1 - t_) * x0 + t_ * eps
    return NoisedBatch(x0, eps, t, x_t, cap, drop)


def optimizer_step(module: torch.nn.Module, opt, ema: Optional[EMA], loss: torch.Tensor, step: int,
                   t0: float) -> dict:
    """One step of `module` on `loss`: backward, the gradient clipped at norm 1, the optimizer, the EMA (if any);
    returns the step's record (`step` counted from 1, `loss`, `grad_norm`, `seconds` since `t0`)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    if ema is not None:
        ema.update(module)
    return {"step": step + 1, "loss": loss.item(), "grad_norm": float(norm), "seconds": time.time() - t0}


def train_transformer(transformer, recipe: DitRecipe, latents: torch.Tensor, caption_ids: torch.Tensor,
                      prompt_embeds: torch.Tensor, pooled_embeds: torch.Tensor, empty: int,
                      on_step: Optional[Callable[[int, dict, EMA], None]] = None) -> tuple[EMA, list[dict]]:
    """Train `transformer` in place. latents: [N, C, h, w] (normalised: mean 0, std 1); caption_ids: [N] indices into
    prompt_embeds [P, L, D] / pooled_embeds [P, D]; `empty`: the index of the empty prompt (CFG dropout)."""
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(transformer.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    ema = EMA(transformer, recipe.ema_decay)
    transformer.train()
    history, t0 = [], time.time()
    for step in range(recipe.steps):
        b = noised_batch(latents, caption_ids, recipe.batch_size, recipe.cfg_dropout, empty, g)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        v = transformer(hidden_states=b.x_t, timestep=b.t * 1000, encoder_hidden_states=prompt_embeds[b.cap],
                        pooled_projections=pooled_embeds[b.cap], return_dict=False)[0]
        rec = optimizer_step(transformer, opt, ema, (v - (b.eps - b.x0)).pow(2).mean(), step, t0)
        history.append(rec)
        if on_step is not None:
            on_step(step + 1, rec, ema)
    transformer.eval()
    return ema, history
