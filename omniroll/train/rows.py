"""Per-row batches (`TrajectoryBatch`, `CleanBatch`: dataclasses of per-row fields): taking some of their rows
(`take_rows`) and moving them to the trainer's device (`rows_to`)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Sequence

import torch


def take_rows(batch, idx: Sequence[int] | torch.Tensor):
    """Rows `idx` of a dataclass of per-row fields (tensors [B, ...], dicts of them, lists of B; `execution` is
    shared), in the order given."""
    idx = torch.as_tensor(idx, dtype=torch.long)
    pick = idx.tolist()
    out = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            out[f.name] = v[idx]
        elif isinstance(v, dict) and f.name != "execution":
            out[f.name] = {k: t[idx] for k, t in v.items()}
        elif isinstance(v, list):
            out[f.name] = [v[i] for i in pick]
    return replace(batch, **out)


#: per-row fields the trainer reads on the host (prompt-length groups, CFG scales, experts, step indices: Python
#: numbers); they stay on the CPU when the rows move to the trainer's device
HOST_FIELDS = ("lengths", "cfg_scale", "experts", "step_indices", "weight_version", "execution", "sde_type")


def rows_to(batch, device: str | torch.device):
    """The same rows with every tensor the model and the loss read on `device` (HOST_FIELDS stay where they are)."""
    out = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if f.name in HOST_FIELDS or v is None:
            continue
        out[f.name] = {k: t.to(device) for k, t in v.items()} if isinstance(v, dict) else v.to(device)
    return replace(batch, **out)
