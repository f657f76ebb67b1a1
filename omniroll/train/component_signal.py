"""The gradient-signal meter per reward component: the cosine between each reward function's own update direction and
the total's, at the step's first optimizer update, and the running share of readings where it is negative.

With several reward functions (`reward.functions`) one can drown another, or pull against it: MARBLE reports that
under a weighted sum the worst reward's gradient points against the total in 80 % of mini-batches. With
`trainer.signal_components: true`, at every reading of the meter (`trainer.signal_every`), on the micro-batches of
the step's first accumulation group (those the meter reads, omniroll/train/grad_signal.py), the update
(omniroll/train/update.py) runs each loss term once more per reward function k with that function's own advantages
A_k (`omniroll.train.advantages.component_advantages`: normalised as `reward.aggregation` normalises the total), and
once with zero advantages. Each backward lands in its own buffer, the trainer's gradient is set aside meanwhile and
put back untouched, so the update is the same bit for bit with the meter on or off. Then

    d_k     = g(A_k) - g(0)        the component's policy gradient (g(0): what the loss pulls without any advantage,
    d_total = g(A)   - g(0)        the KL term to the reference, NFT's neutral term; 0 for the PPO loss without KL)
    cos_k   = <d_k, d_total> / (|d_k| |d_total|)

logged as `signal/component/<name>/cos_total`, and `signal/component/<name>/neg_share`, the share of this run's
readings so far where cos_k < 0 (`ComponentWindow`; a resumed run counts its earlier records). A component whose
advantages are all 0 in the group (it tied in every group there) has no direction: no reading for it that step.

Cost: per reading, (functions + 1) more forward and backward passes of the first accumulation group, and one fp32 copy
of the trainable gradients per function (LoRA: small; full fine-tuning: as many copies of the weights). Off by default.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch


def step_components(config, batch, groups: Sequence, device) -> Optional[dict[str, torch.Tensor]]:
    """{reward function: its own advantages [B] on `device`} for this step's meter per component (the rollout
    `batch`'s components, `groups` its rows' prompt groups), or None when `trainer.signal_components` is off. A row
    without one of the functions' scores is a ValueError naming it (`batch_components`)."""
    from omniroll.train.advantages import batch_components, component_advantages

    if not config.trainer.signal_components:
        return None
    fns = config.reward.functions
    adv = component_advantages(batch_components(batch, list(fns)), {k: f.weight for k, f in fns.items()}, groups,
                               config.reward.aggregation, config.trainer.global_std, config.trainer.adv_clip_max)
    return {k: v.to(device) for k, v in adv.items()}


#: the key of the zero-advantage pass among the buffers (not a reward function's name: those are identifiers)
ZERO = " zero"


class ComponentGradients:
    """The per-component buffers inside one update. `add(name, backward)` runs `backward()` (one loss term's backward
    with that component's advantages) into the buffer of `name`, with the parameters' gradients set aside and put
    back; `readings(all_reduce)` at the first optimizer step, after the data-parallel all-reduce of the trainer's
    gradient (`all_reduce` sums the buffers over the ranks too), gives {name: cos_k or None}."""

    def __init__(self, params: list[torch.nn.Parameter], names: Sequence[str]):
        self.params = params
        self.names = list(names)
        self.buffers: dict[str, Optional[list[torch.Tensor]]] = {n: None for n in [*self.names, ZERO]}

    def add(self, name: str, backward: Callable[[], None]) -> None:
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            backward()
            got = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
        buf = self.buffers[name]
        if buf is None:
            self.buffers[name] = [g.clone() for g in got]
        else:
            for b, g in zip(buf, got):
                b.add_(g)

    def readings(self, all_reduce: Optional[Callable[[list], None]] = None) -> dict[str, Optional[float]]:
        """{name: the cosine between its direction and the total's} (module doc); None where either is zero."""
        bufs = {n: b if b is not None else [torch.zeros_like(p) for p in self.params] for n, b in self.buffers.items()}
        if all_reduce is not None:
            all_reduce([t for n in bufs for t in bufs[n]])
        zero = [z.double() for z in bufs[ZERO]]
        total = [(p.grad.detach().double() if p.grad is not None else torch.zeros_like(z)) - z
                 for p, z in zip(self.params, zero)]
        tt = sum(float((t * t).sum()) for t in total)
        out: dict[str, Optional[float]] = {}
        for n in self.names:
            d = [b.double() - z for b, z in zip(bufs[n], zero)]
            dd = sum(float((x * x).sum()) for x in d)
            dt = sum(float((x * t).sum()) for x, t in zip(d, total))
            out[n] = max(-1.0, min(1.0, dt / math.sqrt(dd * tt))) if dd > 0 and tt > 0 else None
        return out


def component_key(name: str, what: str) -> str:
    """The step-record key of a component's reading: `signal/component/<name>/<what>` (cos_total, neg_share,
    readings)."""
    return f"signal/component/{name}/{what}"


class ComponentWindow:
    """The running count of each component's readings and of those below 0, over the run (`earlier`: this run's step
    records before this process, a resumed run's)."""

    def __init__(self, earlier: Sequence[dict] = ()):
        self.counts: dict[str, list[int]] = {}
        for m in earlier:
            for key, value in m.items():
                if key.startswith("signal/component/") and key.endswith("/cos_total") and value is not None:
                    self._count(key[len("signal/component/"):-len("/cos_total")], float(value))

    def _count(self, name: str, cos: float) -> None:
        c = self.counts.setdefault(name, [0, 0])
        c[0] += 1
        c[1] += int(cos < 0)

    def metrics(self, readings: dict[str, Optional[float]]) -> dict:
        """This step's readings (`cos_total`) with each component's `neg_share` and `readings` so far."""
        out = {}
        for name, cos in readings.items():
            if cos is None:
                continue
            self._count(name, cos)
            n, neg = self.counts[name]
            out.update({component_key(name, "cos_total"): cos, component_key(name, "neg_share"): neg / n,
                        component_key(name, "readings"): n})
        return out
