"""`KLReference`: the weights the KL term pulls the policy towards (`trainer.kl_reference`), one of

    base    the base model (the default): the LoRA disabled, or a frozen copy of the base for full fine-tuning
            (`Policy.reference`);
    ema     an exponential moving average of the trained weights, updated after every step's update with
            `trainer.kl_reference_decay` (AWM's KL to an EMA policy): the policy may move far from the base, but
            only slowly;
    reset   the trained weights as they were after the last step that is a multiple of `trainer.kl_reference_every`
            (GARDO's periodic reference reset): a leash that moves with the policy in jumps.

Both kept references start as the trained weights at the first step (for a fresh LoRA, B = 0: the base model's
function, bitwise). During the reference forward their values stand in for the trained parameters' (`swapped`:
the parameters' `.data`, restored after, so a graph built before it is untouched); they are saved in the checkpoint
(`state_dict`) so a resumed run continues bitwise.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

KINDS = ("base", "ema", "reset")


class KLReference:
    """kind: one of `KINDS`; params: the trained (name, parameter) pairs; decay: `ema`'s; every: `reset`'s."""

    def __init__(self, kind: str, params: list[tuple[str, torch.nn.Parameter]], decay: float = 0.99, every: int = 10):
        if kind not in KINDS:
            raise ValueError(f"kl_reference must be one of {list(KINDS)}, got {kind!r}")
        self.kind, self.decay, self.every = kind, float(decay), int(every)
        self.kept: dict[str, torch.Tensor] = ({} if kind == "base" else
                                              {n: p.detach().clone() for n, p in params})

    @property
    def is_base(self) -> bool:
        return self.kind == "base"

    @torch.no_grad()
    def after_update(self, params: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
        """The reference after step `step`'s update: the EMA moved towards the trained weights, or (reset) the trained
        weights themselves at a multiple of `every`."""
        if self.kind == "ema":
            for n, p in params:
                self.kept[n].mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)
        elif self.kind == "reset" and step % self.every == 0:
            for n, p in params:
                self.kept[n].copy_(p.detach())

    @contextlib.contextmanager
    def swapped(self, params: list[tuple[str, torch.nn.Parameter]]) -> Iterator[None]:
        """The kept values in the trained parameters for the block (their `.data`), the trained ones back after."""
        own = [(p, p.data) for _, p in params]
        try:
            for n, p in params:
                p.data = self.kept[n]
            yield
        finally:
            for p, data in own:
                p.data = data

    def state_dict(self) -> dict:
        return {"kind": self.kind, "kept": {n: t.clone() for n, t in self.kept.items()}}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's reference (ValueError when it was kept for another kind or other parameters)."""
        if state.get("kind", "base") != self.kind or set(state.get("kept", {})) != set(self.kept):
            raise ValueError(f"the checkpoint's KL reference is {state.get('kind', 'base')!r} over "
                             f"{len(state.get('kept', {}))} tensors; this run's is {self.kind!r} over {len(self.kept)}")
        with torch.no_grad():
            for n, t in state["kept"].items():
                self.kept[n].copy_(t)
