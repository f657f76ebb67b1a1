"""Shared helpers for tests/test_weights*.py (tiny SD3 transformer, inputs, PEFT copies)."""

from __future__ import annotations

import copy

import torch
from diffusers import SD3Transformer2DModel
from peft import LoraConfig, get_peft_model

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def tiny_transformer(seed: int = 0) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=64,
    ).eval()


def inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(2, 16, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 64, generator=g),
        timestep=torch.tensor([500.0, 250.0]),
    )


@torch.no_grad()
def forward(module, x=None) -> torch.Tensor:
    return module(**(x or inputs())).sample


def snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@torch.no_grad()
def perturb(module, seed: int = 7, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return module


def peft_copy(base, r: int = 4, seed: int = 3, targets=TARGETS):
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return pm.eval()
