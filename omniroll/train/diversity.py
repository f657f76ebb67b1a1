"""GARDO's diversity-aware advantages (`trainer.diversity_bonus`): a sample that beats its group's mean gets its
advantage multiplied by how far it stands from the nearest other sample of its group, relative to the group's mean of
those distances, so that among equally good samples the unusual ones are pushed hardest (mode coverage); a sample
below its group's mean keeps its advantage.

    d_i = min over j != i in i's group of (1 - cos(f_i, f_j))        the distance to the nearest neighbour
    A_i <- A_i * d_i / mean_group(d)      when A_i > 0               (then clipped to +-adv_clip_max again)

GARDO (arXiv 2512.24138; its PerPromptStatTracker with type "gardo") embeds the pictures with DINOv3, which cannot be
downloaded here. The features f here are the samples' own pixels, average-pooled to 8 x 8 per channel (a clip: per
frame), each minus the step's mean sample (centred, so that a cosine compares what differs rather than the shared
background), then L2-normalised. A group whose distances are all 0 (identical samples) keeps its advantages. The step
logs `diversity_distance`, the mean of d over the batch: a mode-collapse meter (it falls as the samples of a prompt
become alike).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from omniroll.reward.aggregation import group_rows

#: pooled features' side in pixels
POOL = 8


def pixel_features(pixels: torch.Tensor) -> torch.Tensor:
    """float64 [B, D]: samples [B, 3, H, W] or [B, T, 3, H, W] average-pooled to 8 x 8, centred on the batch's mean
    sample, L2-normalised (a zero row stays zero)."""
    x = pixels.detach().double()
    if x.dim() == 5:  # clips: every frame pooled
        B, T = x.shape[:2]
        pooled = F.adaptive_avg_pool2d(x.flatten(0, 1), POOL).reshape(B, -1)
    elif x.dim() == 4:
        pooled = F.adaptive_avg_pool2d(x, POOL).reshape(x.shape[0], -1)
    else:
        raise ValueError(f"diversity: samples must be [B, 3, H, W] or [B, T, 3, H, W], got {tuple(x.shape)}")
    centred = pooled - pooled.mean(0, keepdim=True)
    return centred / centred.norm(dim=1, keepdim=True).clamp_min(1e-12)


def nearest_distances(features: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """float64 [B]: each row's cosine distance to the nearest other row of its group (0 for a group of one)."""
    d = torch.zeros(features.shape[0], dtype=torch.float64)
    for rows in group_rows(groups):
        if len(rows) < 2:
            continue
        f = features[rows]
        dist = (1 - f @ f.T).clamp(0, 2)
        dist.fill_diagonal_(float("inf"))
        d[rows] = dist.min(1).values
    return d


def diversity_weights(distances: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """float64 [B]: d_i / the mean d of i's group (1 where the group's mean is 0)."""
    w = torch.ones_like(distances)
    for rows in group_rows(groups):
        mean = distances[rows].mean()
        if mean > 0:
            w[rows] = distances[rows] / mean
    return w


def with_diversity_bonus(advantages: torch.Tensor, weights: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """The advantages [B] (or [B, W]) with each positive one multiplied by its row's weight, clipped again."""
    w = weights.to(advantages.dtype).view(-1, *([1] * (advantages.dim() - 1)))
    return torch.where(advantages > 0, advantages * w, advantages).clamp(-adv_clip_max, adv_clip_max)


def diversity_bonus(adv, batch, groups: Sequence, adv_clip_max: float):
    """The step's `Advantages` with GARDO's bonus (module doc) on the rollout `batch`'s samples (its `responses`),
    and `diversity_distance` in its metrics."""
    from dataclasses import replace

    if "responses" not in batch.batch.keys():
        raise ValueError("trainer.diversity_bonus: the rollout batch has no samples (responses) to compare: roll out "
                         "with pipeline.output_type pixel or both")
    d = nearest_distances(pixel_features(batch.batch["responses"]), groups)
    out = with_diversity_bonus(adv.advantages, diversity_weights(d, groups), adv_clip_max)
    return replace(adv, advantages=out, metrics={**adv.metrics, "diversity_distance": float(d.mean())})
