"""Training the shapes proxy: the recipe (`ProxyRecipe`), the fit on (picture, prompt, verdict) examples (`fit`), the
agreement with the checker (`agreement`: accuracy, confusion matrix, per category, calibration) and the files
(`save`: model.safetensors, config.json, SHA256SUMS).

The examples themselves come from `omniroll.models.shapes_proxy.data`; the generator's pictures from
`omniroll.evaluation.shapes_proxy` (a layer above: it runs the engine); `omniroll pretrain shapes-proxy` joins them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from omniroll.models.shapes_proxy.net import ProxyNet, encode_prompts, vocabulary
from omniroll.tasks.shapes.grammar import TAGS, parse_prompt


@dataclass(frozen=True)
class ProxyRecipe:
    """Everything that made a proxy: its data (rendered examples, the generator's pictures and their pairings), its
    network and its optimisation."""

    seed: int = 0
    rendered: int = 12000  # rendered examples (data.rendered_examples)
    generator: str = "shapes"  # the model whose pictures it also learns from
    generator_seeds: int = 4  # pictures per training prompt
    generator_prompts: int = 0  # 0: every prompt of each split; N: N of them, evenly spaced (a toy run)
    generator_steps: int = 10  # ODE steps
    generator_base_seed: int = 1001  # not the evaluation's seed (fresh pictures)
    heldout_base_seed: int = 2002  # the held-out generated set: held-out prompts, and train prompts at 1 seed
    heldout_seeds: int = 4
    generated_weight: float = 1.0  # how often a generated example is drawn, relative to a rendered one
    steps: int = 2000
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 1e-4
    word_dim: int = 16
    text_dim: int = 64
    channels: tuple = (16, 32, 32, 32)
    hidden: int = 64

    def prompts(self, prompts: list[str]) -> list[str]:
        """`prompts`, or `generator_prompts` of them evenly spaced."""
        if not self.generator_prompts or self.generator_prompts >= len(prompts):
            return list(prompts)
        return [prompts[int(i)] for i in np.linspace(0, len(prompts) - 1, self.generator_prompts)]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "channels": list(self.channels)}

    @classmethod
    def from_dict(cls, d: dict) -> "ProxyRecipe":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown proxy recipe field(s) {unknown} (fields: {sorted(fields)})")
        d = dict(d)
        if "channels" in d:
            d["channels"] = tuple(int(c) for c in d["channels"])
        recipe = cls(**d)
        for name in ("rendered", "steps", "batch_size", "generator_seeds", "generator_steps", "heldout_seeds",
                     "generator_prompts"):
            least = 0 if name in ("rendered", "generator_seeds", "heldout_seeds", "generator_prompts") else 1
            if int(getattr(recipe, name)) < least:
                raise ValueError(f"proxy recipe {name} must be >= 1 (rendered, generator_prompts, *_seeds: >= 0), "
                                 f"got {getattr(recipe, name)}")
        if not recipe.lr > 0 or recipe.generated_weight < 0:
            raise ValueError(f"proxy recipe lr must be > 0 and generated_weight >= 0, got {recipe.lr}, "
                             f"{recipe.generated_weight}")
        return recipe


def fit(recipe: ProxyRecipe, pictures: np.ndarray, prompts: list[str], labels: np.ndarray,
        weights: Optional[np.ndarray] = None, on_step: Optional[Callable[[int, float], None]] = None) -> ProxyNet:
    """A `ProxyNet` trained with binary cross-entropy on the examples (drawn with probability proportional to
    `weights`, default uniform), AdamW with a cosine decay, seeded by `recipe.seed`; `on_step(step, loss)` after
    each step."""
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    vocab = vocabulary()
    net = ProxyNet(len(vocab), recipe.word_dim, recipe.text_dim, tuple(recipe.channels), recipe.hidden)
    x = torch.from_numpy(np.ascontiguousarray(pictures))
    w = torch.from_numpy(encode_prompts(prompts, vocab))
    y = torch.from_numpy(labels.astype(np.float32))
    p = None if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    opt = torch.optim.AdamW(net.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, recipe.steps) / recipe.steps)))
    net.train()
    for step in range(recipe.steps):
        idx = torch.from_numpy(rng.choice(len(y), size=recipe.batch_size, p=p))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x[idx], w[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.item())
    net.eval()
    return net


@torch.no_grad()
def predict(net: ProxyNet, pictures: np.ndarray, prompts: list[str]) -> np.ndarray:
    """float [N]: the predicted probability that the checker passes each (picture [H, W, 3] uint8, prompt), each
    picture through the network alone: its probability is a function of the picture and its prompt only, bitwise,
    whatever else is scored in the same call. (A batched forward gives a picture other last bits with other
    neighbours, and the reward worker batches whatever arrives together, so a run's rewards, and all it trained on
    them, would differ from one run to the next. Alone costs about 0.8 ms a picture against 0.6 batched.)"""
    vocab = vocabulary()
    words = torch.from_numpy(encode_prompts(prompts, vocab))
    out = [torch.sigmoid(net(torch.from_numpy(np.ascontiguousarray(pictures[i:i + 1])), words[i:i + 1])).numpy()
           for i in range(len(prompts))]
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def agreement(probs: np.ndarray, labels: np.ndarray, prompts: list[str], bins: int = 5) -> dict:
    """How the proxy (pass when prob >= 0.5) agrees with the checker: accuracy, the confusion matrix (checker pass /
    fail x proxy pass / fail), balanced accuracy, per category, the base rate (what "always pass" would score), and
    calibration (Brier score, expected calibration error, and per probability bin the mean prediction against the
    checker's pass rate)."""
    probs, labels = np.asarray(probs, np.float64), np.asarray(labels, bool)
    pred = probs >= 0.5

    def block(m: np.ndarray) -> dict:
        tp, tn = int(np.sum(pred[m] & labels[m])), int(np.sum(~pred[m] & ~labels[m]))
        fp, fn = int(np.sum(pred[m] & ~labels[m])), int(np.sum(~pred[m] & labels[m]))
        n = int(np.sum(m))
        tpr = tp / (tp + fn) if tp + fn else float("nan")
        tnr = tn / (tn + fp) if tn + fp else float("nan")
        return {"n": n, "accuracy": (tp + tn) / n if n else float("nan"),
                "checker_pass_rate": float(np.mean(labels[m])) if n else float("nan"),
                "proxy_pass_rate": float(np.mean(pred[m])) if n else float("nan"),
                "mean_score": float(np.mean(probs[m])) if n else float("nan"),
                "confusion": {"pass_pass": tp, "pass_fail": fn, "fail_pass": fp, "fail_fail": tn},
                "true_pass_rate": tpr, "true_fail_rate": tnr,
                "balanced_accuracy": float(np.nanmean([tpr, tnr])) if n else float("nan")}

    everything = np.ones(len(labels), bool)
    tags = np.asarray([parse_prompt(p).tag for p in prompts])
    out = block(everything)
    out["categories"] = {t: block(tags == t) for t in TAGS if np.any(tags == t)}
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(probs, edges[1:-1]), 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        m = which == b
        if np.any(m):
            table.append({"bin": [float(edges[b]), float(edges[b + 1])], "n": int(np.sum(m)),
                          "mean_score": float(np.mean(probs[m])), "checker_pass_rate": float(np.mean(labels[m]))})
            ece += np.sum(m) / len(labels) * abs(np.mean(probs[m]) - np.mean(labels[m]))
    out["calibration"] = {"brier": float(np.mean((probs - labels) ** 2)), "ece": float(ece), "bins": table}
    return out


def save(net: ProxyNet, recipe: ProxyRecipe, out_dir: str) -> str:
    """Write `model.safetensors`, `config.json` (the network's shape, the vocabulary, the recipe) and `SHA256SUMS`
    into `out_dir`; returns it."""
    from safetensors.torch import save_file

    from omniroll.models.shipped import write_sums

    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, weights)
    os.chmod(weights, 0o644)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"net": net.config, "vocabulary": vocabulary(), "recipe": recipe.to_dict()}, f, indent=1)
        f.write("\n")
    write_sums(out_dir)
    return out_dir
