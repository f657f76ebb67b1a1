"""Guidance distillation of the shapes model's transformer: a student that draws CFG-free what its teacher draws with
classifier-free guidance at scale w, so one forward per step samples as well as two.

    x_t = (1 - t) x0 + t eps                       (forward-noised latents of the world's pictures, t logit-normal)
    target = v_u + w (v_c - v_u)                   (the frozen teacher's guided velocity; v_u for the empty prompt)
    loss = |v_student(x_t, c) - target|^2

The student starts as the teacher. `cfg_dropout` of the captions are the empty prompt, whose target is the teacher's
unconditional velocity, so the student still has an unconditional branch. The weights a sampler should use are the
exponential moving average (`ema_decay`). A distilled checkpoint's sampling default is guidance 1.0 (CFG off): every
algorithm then rolls out, trains and is judged in that one regime.

With `lora_rank` r > 0 only a rank-r LoRA (alpha 2r, PEFT's) on the attention and feed-forward projections learns,
and the EMA's adapter is merged into the weights at the end: the checkpoint is a plain transformer either way.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from omniroll.models.shapes.dit import EMA, noised_batch, optimizer_step


@dataclass(frozen=True)
class DistillRecipe:
    steps: int = 0  # 0: no distillation (the shipped model is guided: CFG 4.5)
    guidance: float = 4.5  # the teacher's CFG scale the student learns to draw at CFG off
    batch_size: int = 64
    lr: float = 5e-4
    cfg_dropout: float = 0.1
    ema_decay: float = 0.995
    num_latents: int = 20_000  # latents encoded when distilling an existing checkpoint (`omniroll pretrain --from`)
    seed: int = 4
    lora_rank: int = 0  # 0: the whole transformer learns; r > 0: a rank-r LoRA, merged at the end (module doc)

    def __post_init__(self):
        r = self.lora_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 512:
            raise ValueError(f"distill.lora_rank must be an int in [0, 512] (0: the whole transformer), "
                             f"got {r!r}")


#: the projections a LoRA student adapts (those the trainer's shapes recipes adapt)
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")


def distill_transformer(teacher, recipe: DistillRecipe, latents: torch.Tensor, caption_ids: torch.Tensor,
                        prompt_embeds: torch.Tensor, pooled_embeds: torch.Tensor, empty: int,
                        on_step: Optional[Callable[[int, dict, EMA], None]] = None) -> tuple[EMA, list[dict]]:
    """Distil `teacher` (left unchanged) into a copy of it; returns the student's EMA and the history. latents:
    [N, C, h, w] (normalised); caption_ids: [N] indices into prompt_embeds [P, L, D] / pooled_embeds [P, D]; `empty`:
    the index of the empty prompt."""
    teacher = teacher.eval().requires_grad_(False)
    student = student_of(teacher, recipe.lora_rank, recipe.seed)
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0)
    ema = EMA(student, recipe.ema_decay)
    history, t0 = [], time.time()
    for step in range(recipe.steps):
        # 1. a batch of forward-noised latents, a share of them captioned with the empty prompt
        b = noised_batch(latents, caption_ids, recipe.batch_size, recipe.cfg_dropout, empty, g)
        x_t, t, cap = b.x_t, b.t, b.cap

        # 2. the teacher's guided velocity (its unconditional one for the empty prompt)
        uncond = torch.full_like(cap, empty)
        with torch.no_grad():
            both = teacher(hidden_states=torch.cat([x_t, x_t]), timestep=torch.cat([t, t]) * 1000,
                           encoder_hidden_states=torch.cat([prompt_embeds[cap], prompt_embeds[uncond]]),
                           pooled_projections=torch.cat([pooled_embeds[cap], pooled_embeds[uncond]]),
                           return_dict=False)[0]
            v_c, v_u = both.chunk(2)
            target = torch.where(b.drop[:, None, None, None], v_u, v_u + recipe.guidance * (v_c - v_u))

        # 3. the student's step
        v = student(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=prompt_embeds[cap],
                    pooled_projections=pooled_embeds[cap], return_dict=False)[0]
        rec = optimizer_step(student, opt, ema, (v - target).pow(2).mean(), step, t0)
        history.append(rec)
        if on_step is not None:
            on_step(step + 1, rec, ema)
    if recipe.lora_rank > 0:
        ema.module.fuse_lora()  # the averaged adapter into the weights, then the adapter's layers removed
        ema.module.unload_lora()
    return ema, history


def student_of(teacher, lora_rank: int, seed: int):
    """The student in training mode: a copy of the teacher, all of it trainable (`lora_rank` 0), or frozen with a
    rank-`lora_rank` LoRA (alpha 2 r) on `LORA_TARGETS`, only the adapter trainable, its random init drawn from
    `seed` (not from torch's global generator)."""
    student = copy.deepcopy(teacher).train()
    if lora_rank == 0:
        return student.requires_grad_(True)
    from peft import LoraConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=list(LORA_TARGETS)))
    for name, p in student.named_parameters():
        p.requires_grad_("lora_" in name)
    return student
