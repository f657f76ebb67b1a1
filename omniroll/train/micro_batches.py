"""The micro-batches of one inner epoch: a shuffle of the step's rows, cut half by half of the prompt groups, and the
gradient-accumulation groups they form.

    plan = epoch_micro_batches(B, halves, micro_batch_size, per_update, generator)
    plan.chunks      # row-index tensors in training order
    plan.half_a      # per chunk: True (half A), False (half B), None (no halves)
    plan.groups      # per accumulation group: the indices of its chunks (one optimizer step each)

    plan = whole_group_micro_batches(groups, halves, micro_batch_size, per_update, generator)   # groups kept whole

The rows are shuffled once (`generator`: from seed, step and epoch only); with `halves` (the gradient-signal meter's
split of the prompt groups, omniroll/train/grad_signal.py) the shuffled rows of each half are cut separately, the
chunks alternate A, B, A, B, ... and inside each accumulation group the half-A chunks come first, so the meter reads
half A's gradient with one copy. The split is the same whether the meter reads it or not (`trainer.signal_every`
changes nothing in the update). Each micro-batch's loss (a mean over its rows) is weighted by its rows' share of its
accumulation group, so the group's gradient is the mean over its rows however they were cut.

`whole_group_micro_batches` (for a pairwise or group objective, through `Algorithm.micro_batches`) shuffles the
prompt groups instead of the rows and packs whole groups into micro-batches of at most `micro_batch_size` rows (a
larger group is a micro-batch of its own), so a pair or a group is never split; the meter's halves are whole groups
already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class EpochPlan:
    chunks: list[torch.Tensor]
    half_a: list[Optional[bool]]
    groups: list[list[int]]

    def group_rows(self) -> list[int]:
        """Rows per accumulation group."""
        return [sum(len(self.chunks[c]) for c in g) for g in self.groups]


def epoch_micro_batches(B: int, halves: Optional[torch.Tensor], micro_batch_size: int, per_update: Optional[int],
                        generator: torch.Generator) -> EpochPlan:
    """The epoch's micro-batches (module doc). per_update: chunks per optimizer step (None: one step per epoch)."""
    perm = torch.randperm(B, generator=generator)

    def cut(rows: torch.Tensor) -> list[torch.Tensor]:
        return [c for c in rows.split(micro_batch_size) if len(c)]  # an empty half cuts into nothing

    if halves is None:
        return _plan([(c, None) for c in cut(perm)], per_update)
    in_a = halves[perm]
    return _plan(_alternate(cut(perm[in_a]), cut(perm[~in_a])), per_update)


def whole_group_micro_batches(groups: torch.Tensor, halves: Optional[torch.Tensor], micro_batch_size: int,
                              per_update: Optional[int], generator: torch.Generator) -> EpochPlan:
    """The epoch's micro-batches with every prompt group whole (module doc). groups: long [B], each row's group."""
    ids = torch.unique(groups)
    members = [torch.nonzero(groups == g).flatten() for g in ids[torch.randperm(len(ids), generator=generator)]]

    def pack(whole: list[torch.Tensor]) -> list[torch.Tensor]:
        out, part = [], []
        for m in whole:
            if part and sum(len(x) for x in part) + len(m) > micro_batch_size:
                out.append(torch.cat(part))
                part = []
            part.append(m)
        return out + ([torch.cat(part)] if part else [])

    if halves is None:
        return _plan([(c, None) for c in pack(members)], per_update)
    in_a = [bool(halves[m[0]]) for m in members]
    return _plan(_alternate(pack([m for m, a in zip(members, in_a) if a]),
                            pack([m for m, a in zip(members, in_a) if not a])), per_update)


def group_index(uids) -> torch.Tensor:
    """long [B]: each row's prompt group, numbered in order of first appearance."""
    first: dict = {}
    return torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.long)


def _alternate(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[tuple[torch.Tensor, Optional[bool]]]:
    """The chunks of half A and half B in turn: A, B, A, B, ..."""
    seq = []
    for i in range(max(len(a), len(b))):
        seq += ([(a[i], True)] if i < len(a) else []) + ([(b[i], False)] if i < len(b) else [])
    return seq


def _plan(seq: list[tuple[torch.Tensor, Optional[bool]]], per_update: Optional[int]) -> EpochPlan:
    """The accumulation groups of `per_update` chunks (None: all in one), half A's (or no halves') first in each."""
    per = per_update or max(len(seq), 1)
    ordered, groups = [], []
    for start in range(0, len(seq), per):
        part = seq[start:start + per]
        part = [x for x in part if x[1] is not False] + [x for x in part if x[1] is False]  # A (or no halves) first
        groups.append(list(range(len(ordered), len(ordered) + len(part))))
        ordered += part
    return EpochPlan([c for c, _ in ordered], [h for _, h in ordered], groups)


def group_rows(B: int, rows_a: Optional[int], micro_batch_size: int, per_update: Optional[int]) -> list[int]:
    """Rows per accumulation group of an epoch of B rows, `rows_a` of them in half A (None: no halves): what
    `epoch_micro_batches` gives, from the counts alone (the data-parallel driver plans every rank's groups)."""
    halves = torch.arange(B) < rows_a if rows_a is not None else None
    return epoch_micro_batches(B, halves, micro_batch_size, per_update, torch.Generator().manual_seed(0)).group_rows()
