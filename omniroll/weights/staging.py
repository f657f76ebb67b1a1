"""`StagingPool`: the staging tensors of staged full updates, kept from one update to the next.

A staged update receives every tensor into a staging copy and, at the commit, swaps each parameter's storage for its
staged one. Allocating that copy afresh for every update cost more than the copy itself (fresh pages fault in on
first touch): the in-process full sync fell from 0.58 to 0.32 of memcpy bandwidth when updates became transactions.
The pool keeps each parameter's previous storage after a commit and hands it out as the staging tensor of the next
update of the same name, when shape, dtype and device still match: double buffering, no allocation in steady state.

A kept storage is handed out only if nothing else refers to it any more (a tensor someone took from the parameter
before the update, a view of it): such a storage is left alone and a fresh one is allocated instead. The all-or-
nothing rule is unchanged: staging tensors are written only before the commit, and the module only at the commit.
Memory: the one extra copy of the updated tensors that a staged update needs now stays between updates; `clear()`
drops it (the engine does before it sleeps).

The pool also keeps the receiver's targets (which tensor each name lands in) with the `ModuleTree` they were read
from: the next update checks the tree instead of walking the module again, and reads them afresh once it changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tree import ModuleTree


def _unshared(t: torch.Tensor) -> bool:
    """Whether `t` is the only tensor on its storage (the use count is `t`'s and the storage handle's own)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # no way to tell: never reuse
        return False
    storage = t.untyped_storage()
    return count(storage._cdata) <= 2 and t.storage_offset() == 0 and t.is_contiguous()


class StagingPool:
    def __init__(self) -> None:
        self._spare: dict[str, torch.Tensor] = {}
        self.reused = 0  # staging tensors handed out again (for tests and stats)
        self._targets: tuple[ModuleTree, Any] | None = None

    def take(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like `like` to stage `name` into: the kept one when it fits and is unshared, else new."""
        t = self._spare.pop(name, None)
        if (t is not None and t.shape == like.shape and t.dtype == like.dtype and t.device == like.device
                and _unshared(t)):
            self.reused += 1
            return t
        return torch.empty_like(like)

    def give(self, name: str, previous: torch.Tensor) -> None:
        """Keep a parameter's previous storage (after the commit swapped it out) for the next update of `name`."""
        self._spare[name] = previous

    def kept_targets(self, module: nn.Module) -> Any:
        """What `keep_targets` kept for `module`, if the module's tree is still the one they were read from; else
        None."""
        kept = self._targets
        if kept is not None and kept[0].module is module and kept[0].current():
            return kept[1]
        return None

    def keep_targets(self, tree: ModuleTree, targets: Any) -> None:
        self._targets = (tree, targets)

    def clear(self) -> None:
        self._spare = {}
        self._targets = None

    def __len__(self) -> int:
        return len(self._spare)
