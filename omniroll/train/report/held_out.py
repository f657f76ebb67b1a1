"""Held-out rewards (`reward.held_out`): reward functions scored on the validation samples only, never trained on,
logged beside the trained reward, and a warning when the trained reward rises while a held-out one falls.

They are scored in the trainer's process, on the pictures the validation already drew (fixed prompts, fixed seeds),
after the reward workers scored the trained functions: the rollout's reward workers never see them, so no training
sample is ever scored by one. Each validation logs, in `metrics.jsonl` (a record `{"step", "validation": tag, ...}`),
`validation.jsonl` and the trackers:

    val/held_out/<name>/score    the function's mean over the validation samples it scored
    val/held_out/<name>/failed   samples it could not score (named in the console line; never counted as 0)
    val/held_out/<name>/z        paired z of its change since the previous validation (per sample, same seeds)
    val/held_out/trained_z       the same for the trained reward (the weighted sum the trainer optimises)
    val/held_out/<name>/z_start  paired z of its change since the first validation (from the third one on)
    val/held_out/trained_z_start the same for the trained reward
    val/held_out/<name>/falling  1.0 when the warning fires for it, else 0.0

The decision (`divergence`): validation samples use fixed seeds, so the last two validations pair sample by sample.
For the trained reward and each held-out function, the per-sample differences d (last - previous) give a paired z,
mean(d) / (std(d) / sqrt(n)) with the sample std (`omniroll.evaluation.paired.paired_z`, a paired t statistic); the
warning fires for a held-out function when both changes are detectable at |z| >= 2 (`DETECTABLE_Z`, the project's
paired threshold): trained z >= +2 and held-out z <= -2, over the samples both validations scored, and at least
`MIN_PAIRS` (6) of them; with fewer, no warning can fire (said once). At 6 pairs a t statistic of 5 degrees of freedom
passes 2 by chance in about 5 % of comparisons on each side, and the warning needs both sides. The same decision is
taken against the first validation (the run's start), so a run whose proxy peaked and turned is still caught: in a
96-step hacking run both rewards fell between the last two validations (trained z -2.2, held out -7.1), while since
the start the proxy stood detectably up (z +3.0) and the judge down (z -5.8) (docs/training/rewards_that_hold.md).
While the last validation says so, every step line ends with `held-out falling: <name> (trained z .., held-out z ..)`
(`since the start` for that comparison) and the step's record carries `held_out_warning`.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from omniroll.evaluation.paired import DETECTABLE_Z, paired_z
from omniroll.reward import RewardManager, RewardSample
from omniroll.train.report.tracking import read_jsonl

#: fewest samples both validations scored for the warning to be decided (module doc)
MIN_PAIRS = 6
#: a logged z is clipped to +-this (a change every sample shares exactly has z +-inf)
Z_LOGGED = 1e3


@dataclass
class Divergence:
    """One held-out function's paired comparison of the last two validations."""

    name: str
    trained_z: float
    held_out_z: float
    pairs: int
    falling: bool  # trained_z >= z and held_out_z <= -z on at least MIN_PAIRS pairs


def _usable(*values: Optional[float]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def divergence(trained: tuple[Sequence, Sequence], held_out: Mapping[str, tuple[Sequence, Sequence]],
               z: float = DETECTABLE_Z, min_pairs: int = MIN_PAIRS) -> list[Divergence]:
    """For each held-out function: (previous, last) per-sample scores of the trained reward and of the function, the
    same samples in the same order (None: not scored there, left out of the pairs); the paired z of each change over
    the samples all four scored, and whether the trained reward detectably rose while the function detectably fell."""
    prev_t, last_t = trained
    out = []
    for name, (prev_h, last_h) in held_out.items():
        if not len(prev_t) == len(last_t) == len(prev_h) == len(last_h):
            raise ValueError(f"held-out {name!r}: the two validations hold different samples ({len(prev_t)}, "
                             f"{len(last_t)}, {len(prev_h)}, {len(last_h)})")
        keep = [i for i in range(len(prev_t)) if _usable(prev_t[i], last_t[i], prev_h[i], last_h[i])]
        zt = paired_z([prev_t[i] for i in keep], [last_t[i] for i in keep])
        zh = paired_z([prev_h[i] for i in keep], [last_h[i] for i in keep])
        out.append(Divergence(name, zt, zh, len(keep), len(keep) >= min_pairs and zt >= z and zh <= -z))
    return out


def warning_text(found: Sequence[Divergence]) -> str:
    """`held-out falling: aesthetic (trained z +2.4, held-out z -3.1)`, or "" when none falls."""
    parts = [f"{d.name} (trained z {d.trained_z:+.1f}, held-out z {d.held_out_z:+.1f})" for d in found if d.falling]
    return "held-out falling: " + ", ".join(parts) if parts else ""


def batch_samples(batch: Any) -> list[RewardSample]:
    """The validation batch's pictures as the reward functions see them (as the agent loop builds them)."""
    nt = batch.non_tensor_batch
    pixels = batch.batch["responses"]
    n = len(pixels)
    ids = list(nt.get("request_id", [f"val-row-{i}" for i in range(n)]))
    prompts = list(nt.get("raw_prompt", [""] * n))
    sources = list(nt.get("data_source", ["val"] * n))
    return [RewardSample(sample_id=str(ids[i]), image=pixels[i].numpy(), prompt=_prompt(prompts[i]),
                         data_source=str(sources[i] or "")) for i in range(n)]


def _prompt(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[-1], dict):  # chat messages
        return str(raw[-1].get("content", ""))
    return str(raw)


def trained_scores(batch: Any) -> list[Optional[float]]:
    """Each validation sample's trained reward (the weighted sum; None where it failed)."""
    infos = batch.non_tensor_batch.get("reward_extra_info")
    if infos is None:
        return [None] * len(batch)
    return [info.get("score") if isinstance(info, dict) else None for info in infos]


class HeldOutRewards:
    """The run's held-out functions (`reward.held_out`), scored at each validation (`observe`). A resumed run reads
    the previous validation's per-sample scores back from validation.jsonl (`held_out/rows`)."""

    def __init__(self, functions: Mapping, out_dir: str):
        self.manager = RewardManager({"functions": dict(functions)})
        self.names = self.manager.names
        self.out_dir = out_dir
        self.previous: Optional[dict] = None  # {"trained": [...], name: [...]} of the last validation
        self.first: Optional[dict] = None  # the same of the run's first validation
        self.warning = ""  # the step lines' warning while the last validation holds it
        self._read = False
        self._said_few = False

    async def _score(self, samples: list[RewardSample]) -> list:
        try:
            return await self.manager.score(samples)
        finally:  # an HTTP scorer's client belongs to this call's event loop
            await self.manager.aclose()

    def step_metrics(self) -> dict:
        """What a training step's record carries: `held_out_warning` while the last validation says so."""
        return {"held_out_warning": self.warning} if self.warning else {}

    def observe(self, batch: Any, tag: str, step: int, tracker: Any, log: Callable[[str], None]) -> dict:
        """Score the validation `batch` with every held-out function, compare with the previous validation, log (the
        console lines, metrics.jsonl, the trackers). Returns the metrics and `held_out/rows` for validation.jsonl."""
        if not self._read:  # a resumed run: the first and the previous validations of the run it continues
            self._read = True
            recs = [r for r in read_jsonl(os.path.join(self.out_dir, "validation.jsonl")) if "held_out/rows" in r]
            self.previous = recs[-1]["held_out/rows"] if recs else None
            self.first = recs[0]["held_out/rows"] if len(recs) > 1 else self.previous
        samples = batch_samples(batch)
        results = asyncio.run(self._score(samples))
        rows: dict[str, list] = {"trained": trained_scores(batch)}
        metrics: dict[str, float] = {}
        failures = []
        for name in self.names:
            vals = [r.components.get(name) for r in results]
            rows[name] = vals
            ok = [v for v in vals if v is not None]
            if ok:  # none scored: no score at all (never a 0)
                metrics[f"val/held_out/{name}/score"] = sum(ok) / len(ok)
            metrics[f"val/held_out/{name}/failed"] = float(len(vals) - len(ok))
            failures += [f"{name} on {s.sample_id}: {r.extra_info.get(f'{name}/error')}"
                         for s, r, v in zip(samples, results, vals) if v is None]
        lines = [f"held-out {tag}: " + ", ".join(f"{n} {metrics[f'val/held_out/{n}/score']:.4f}"
                                                 if f"val/held_out/{n}/score" in metrics else f"{n} -"
                                                 for n in self.names)]
        if failures:
            lines.append(f"held-out {tag}: {len(failures)} score(s) failed (left out, never 0): "
                         + "; ".join(failures[:8]) + (" ..." if len(failures) > 8 else ""))
        refs = [("", self.previous)] + ([("_start", self.first)] if self.first is not self.previous else [])
        warnings = []
        for suffix, ref in refs:
            if ref is None or len(ref.get("trained", [])) != len(rows["trained"]):
                continue
            found = divergence((ref["trained"], rows["trained"]),
                               {n: (ref[n], rows[n]) for n in self.names if n in ref})
            for d in found:  # logged within +-Z_LOGGED (every sample changed alike: +-inf; JSON has no inf)
                metrics[f"val/held_out/{d.name}/z{suffix}"] = max(-Z_LOGGED, min(Z_LOGGED, d.held_out_z))
                metrics[f"val/held_out/{d.name}/falling"] = max(metrics.get(f"val/held_out/{d.name}/falling", 0.0),
                                                                float(d.falling))
                metrics[f"val/held_out/trained_z{suffix}"] = max(-Z_LOGGED, min(Z_LOGGED, d.trained_z))
            text = warning_text(found)
            if text:
                warnings.append(text + (" since the start" if suffix else ""))
                since = "the first validation" if suffix else "the previous validation"
                lines.append(f"WARNING {text} since {since}: the trained reward rises while a reward it never saw "
                             f"falls (reward hacking?); look at the grids")
            few = [d for d in found if d.pairs < MIN_PAIRS]
            if few and not self._said_few:
                self._said_few = True
                lines.append(f"held-out: {few[0].pairs} validation sample(s) scored on both sides, fewer than "
                             f"{MIN_PAIRS}: the held-out warning cannot fire (more val_prompts or val_kwargs.n)")
        self.warning = "; ".join(warnings)
        if self.first is None:
            self.first = rows
        self.previous = rows
        for line in lines:
            log(line)
        tracker.log_held_out(tag, step, metrics)
        return {**metrics, "held_out/rows": rows}
