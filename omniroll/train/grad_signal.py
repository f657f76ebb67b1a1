"""The gradient-signal meter: the cosine between the update directions of two halves of a step's prompt groups, and
the per-sample signal-to-noise ratio it implies.

A step's update direction is a sum over its samples. Model each half's gradient as N samples' worth of a common
signal mu plus independent noise of variance sigma^2 per sample; then the expected cosine between two halves of N
samples each is

    E cos = N s / (1 + N s),   s = |mu|^2 / sigma^2   (the per-sample signal-to-noise ratio)

so one reading gives s = cos / (N (1 - cos)) and the batch size at which two independent batches' gradients agree
with cosine 0.5 is 1 / s. A cosine about 0 over many steps says the update is noise: Adam then takes steps in random
directions (a random walk that a KL term can stop but not steer).

The halves are whole prompt groups (`signal_halves`: a random half of the groups, from the trainer seed and the
step), because GRPO's advantages tie the samples of a group together. The update's micro-batches are built half by
half (`omniroll.train.micro_batches`): in the step's first gradient-accumulation group the half-A micro-batches come
first, so `HalfGradient` needs one copy of the trainable gradients (taken when the first half-B micro-batch starts)
and the accumulated gradient at the first optimizer step: b = g - a. For LoRA that copy is small (the demo's rank-16
adapter: 417,792 floats, 1.6 MB); for full fine-tuning it is one more fp32 copy of the denoiser's weights (SD3.5-Medium,
2.5 B parameters: 10 GB), so `trainer.signal_every: 0` turns it off there.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from omniroll.sampling.seeds import signal_halves_seed
from omniroll.train.algorithms.terms import LossInput


def signal_halves(uids: Sequence, seed: int, step: int) -> Optional[torch.Tensor]:
    """bool [B]: True for the rows of half A (half of the prompt groups, rounded down, drawn from (seed, step)); None
    when the step has fewer than two prompt groups (nothing to compare)."""
    groups = list(dict.fromkeys(uids))
    if len(groups) < 2:
        return None
    g = torch.Generator().manual_seed(signal_halves_seed(seed, step))
    order = torch.randperm(len(groups), generator=g).tolist()
    in_a = {groups[i] for i in order[: len(groups) // 2]}
    return torch.tensor([u in in_a for u in uids], dtype=torch.bool)


def snr_from_cos(cos: float, n: float) -> float:
    """The per-sample signal-to-noise ratio s that makes E cos = N s / (1 + N s) equal `cos` at halves of `n`
    samples; 0.0 when cos <= 0 (no signal detected)."""
    if not cos > 0 or n <= 0:
        return 0.0
    return cos / (n * (1.0 - min(cos, 1.0 - 1e-12)))


def samples_for_cos(s: float, target: float = 0.5) -> float:
    """Samples per batch at which two independent batches' gradients reach cosine `target` (inf when s is 0)."""
    return target / (s * (1.0 - target)) if s > 0 else math.inf


class HalfGradient:
    """The meter inside one update (omniroll/train/update.py): `start_b()` when the first half-B micro-batch of the
    first accumulation group starts (copies the gradient so far: half A's), `reading()` at that group's optimizer
    step, after the data-parallel all-reduce of the gradients (`all_reduce`, when given, sums the copy over the ranks
    too). rows_a / rows_b: this process's rows of each half in that group."""

    def __init__(self, params: list[torch.nn.Parameter], all_reduce: Optional[Callable[[list], None]] = None):
        self.params = params
        self.all_reduce = all_reduce
        self.a: Optional[list[torch.Tensor]] = None
        self.rows_a = 0
        self.rows_b = 0

    def count(self, rows: int, half_a: bool) -> None:
        if half_a:
            self.rows_a += rows
        else:
            self.rows_b += rows

    def start_b(self) -> None:
        if self.a is None:
            self.a = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def reading(self) -> Optional[float]:
        """cos(a, b) of the two halves' summed gradients (b = g - a); None when a half is empty everywhere or either
        gradient is zero."""
        self.start_b()  # a process whose first group held only half A: all of it is A
        counts = torch.tensor([float(self.rows_a), float(self.rows_b)], dtype=torch.float64)
        if self.all_reduce is not None:
            self.all_reduce(self.a + [counts])
        self.rows_a, self.rows_b = int(counts[0]), int(counts[1])
        ga = gg = aa = 0.0
        for p, a in zip(self.params, self.a):
            g = p.grad.detach().double() if p.grad is not None else torch.zeros_like(a, dtype=torch.float64)
            a = a.double()
            ga += float((g * a).sum())
            gg += float((g * g).sum())
            aa += float((a * a).sum())
        ab, bb = ga - aa, gg - 2 * ga + aa
        if self.rows_a == 0 or self.rows_b == 0 or aa <= 0 or bb <= 0:
            return None
        return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def signal_metrics(cos: Optional[float], rows_a: int, rows_b: int) -> dict:
    """One reading's metrics (none when the meter did not read): grad_cos and grad_cos_rows (samples per half, the
    two halves' mean)."""
    if cos is None:
        return {}
    return {"grad_cos": cos, "grad_cos_rows": (rows_a + rows_b) / 2}


class SignalWindow:
    """The meter's last `window` readings (one reading is noisy: at the demo's 24 samples per half, pure noise reads
    +- 0.08): their mean, its standard error, and the signal-to-noise ratio s the mean implies. `earlier`: the step
    records of this run before this process (a resumed run)."""

    def __init__(self, window: int, earlier: Sequence[dict] = ()):
        self.window = int(window)
        self.readings: list[tuple[float, float]] = [(float(m["grad_cos"]), float(m.get("grad_cos_rows", 0.0)))
                                                     for m in earlier if m.get("grad_cos") is not None]

    def metrics(self, reading: dict) -> dict:
        """`reading` (signal_metrics' output for this step) plus grad_cos_mean, grad_cos_se (nan below 2 readings),
        grad_cos_readings (in the window), grad_snr and grad_samples_for_cos50 (None: no signal, mean <= 0)."""
        if not reading:
            return {}
        self.readings.append((reading["grad_cos"], reading["grad_cos_rows"]))
        last = self.readings[-self.window:]
        k = len(last)
        mean = sum(c for c, _ in last) / k
        se = (sum((c - mean) ** 2 for c, _ in last) / (k - 1) / k) ** 0.5 if k > 1 else math.nan
        s = snr_from_cos(mean, sum(n for _, n in last) / k)
        return {**reading, "grad_cos_mean": mean, "grad_cos_se": se, "grad_cos_readings": k, "grad_snr": s,
                "grad_samples_for_cos50": samples_for_cos(s) if s > 0 else None}


def group_gradients(policy, algorithm, rows, advantages: torch.Tensor, uids: Sequence, plan) -> dict:
    """{uid: the flattened update direction of that prompt group} at the policy's current weights: the gradient of
    the sum over the group's rows of the algorithm's loss terms (each term's row mean times its rows, over the terms),
    what the trainer's update accumulates for those rows. `algorithm.prepare` runs first on all `rows`; each group is
    one micro-batch (its index the `chunk` a forward-process algorithm seeds its noise with). For measurements before
    training (benchmarks/grad_signal.py): nothing is stepped."""
    anchors = algorithm.prepare(policy, rows, plan)
    params = policy.parameters()
    out = {}
    for c, u in enumerate(dict.fromkeys(uids)):
        idx = torch.tensor([i for i, x in enumerate(uids) if x == u], dtype=torch.long)
        for p in params:
            p.grad = None
        mb = rows.rows(idx)
        T = algorithm.num_terms(mb, anchors)
        for k in range(T):
            terms = algorithm.loss(LossInput(policy, mb, idx, advantages[idx], k, anchors, plan, epoch=0, chunk=c,
                                             first_update=True))
            (terms.loss * (len(idx) / T)).backward()
        out[u] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                            for p in params])
    for p in params:
        p.grad = None
    return out


def fit_snr(sizes: Sequence[float], cosines: Sequence[float]) -> float:
    """The per-sample signal-to-noise ratio s whose curve N s / (1 + N s) fits the mean cosines at batch sizes N
    (least squares over log-spaced s in [1e-7, 10]; 0.0 when no positive s fits better than none)."""
    best, best_err = 0.0, sum(c * c for c in cosines)
    for k in range(0, 801):
        s = 10 ** (-7 + 8 * k / 800)
        err = sum((c - n * s / (1 + n * s)) ** 2 for n, c in zip(sizes, cosines))
        if err < best_err:
            best, best_err = s, err
    return best
