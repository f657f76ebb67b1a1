"""`VersionStore`: the trainable weights of the asynchronous trainer's last versions (LoRA: the adapter; full: every
trained weight), so a window step can be rescored under the version that ran it; saved with a checkpoint."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from omniroll.train.policy import Policy


class VersionStore:
    """The trainable weights of the last `keep` versions (LoRA: the adapter; full: every trained weight), so a window
    step can be rescored under the version that ran it. Memory: `keep` copies of the trained weights (none when
    keep == 0, the synchronous trainer)."""

    def __init__(self, policy: "Policy", keep: int):
        self.policy, self.keep = policy, int(keep)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.current: Optional[int] = None

    def record(self, version: int) -> None:
        """The policy's weights now are `version` (call after each optimizer update's sync, and at start)."""
        self.current = int(version)
        if self.keep > 0:
            self.snapshots[self.current] = [p.detach().clone() for p in self.policy.parameters()]
            for v in [v for v in self.snapshots if v < self.current - self.keep]:
                del self.snapshots[v]

    def has(self, version: int) -> bool:
        return version == self.current or version in self.snapshots

    @contextlib.contextmanager
    def weights(self, version: int) -> Iterator[None]:
        """The policy holds `version`'s weights inside the block (exact copies), its current ones after."""
        if version == self.current:
            yield
            return
        if version not in self.snapshots:
            raise KeyError(f"weight version {version} is not kept (kept: {sorted(self.snapshots)}, current "
                           f"{self.current}); the trainer keeps max_staleness + 1 versions")
        params = self.policy.parameters()
        with torch.no_grad():
            for p, s in zip(params, self.snapshots[version]):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(params, self.snapshots[self.current]):
                    p.copy_(s)

    def adopt(self, snapshots: dict[int, list[torch.Tensor]], current: int) -> None:
        """Another store's kept versions (a data-parallel rank takes the trainer's), then `record(current)`."""
        self.snapshots = {int(v): [t.clone() for t in snap] for v, snap in snapshots.items()}
        self.record(current)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """`versions.safetensors`: every kept version's weights (a resumed run regenerates in-flight batches with
        them)."""
        from safetensors.torch import save_file

        names = [n for n, _ in self.policy.named_parameters()]
        tensors = {f"{v}/{n}": t.contiguous() for v, snap in self.snapshots.items() for n, t in zip(names, snap)}
        if tensors:
            save_file(tensors, os.path.join(path, "versions.safetensors"))

    def load(self, path: str, current: int) -> None:
        from safetensors.torch import load_file

        f = os.path.join(path, "versions.safetensors")
        names = [n for n, _ in self.policy.named_parameters()]
        loaded = load_file(f) if os.path.isfile(f) else {}
        versions = sorted({int(k.split("/", 1)[0]) for k in loaded})
        self.snapshots = {v: [loaded[f"{v}/{n}"] for n in names] for v in versions if v >= current - self.keep}
        self.record(current)
