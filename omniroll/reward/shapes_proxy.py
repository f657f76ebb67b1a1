"""The shapes proxy reward (`fn: shapes_proxy`): a learned scorer that can be fooled, the predicted probability that
the shapes world's exact checker passes the picture (`omniroll.models.shapes_proxy`), for studying reward hacking
against a judge that cannot be fooled (train on this, judge with `shapes_strict` or `omniroll eval`).

Per sample a dict: `score` (the probability, in [0, 1]), `strict_pred` (1.0 when the probability is at least 0.5:
the proxy's verdict) and `<category>` (that verdict, for the sample's own category only), which land in the row's
`extra_info` as `<name>/<key>`. A prompt outside the grammar is that row's error naming the nearest valid prompt, a
video or a picture that is not 64 x 64 is that row's error (never a reward of 0). kwargs: `path`, a proxy directory
(`omniroll pretrain shapes-proxy --out DIR` writes DIR/weights; default the shipped one).
"""

from __future__ import annotations

import os

import numpy as np

from omniroll.tasks.shapes.grammar import PromptError, parse_prompt
from omniroll.tasks.shapes.grammar import check_prompts as grammar_problems

SIZE = 64


def proxy_scores(samples, path: str | None = None) -> list:
    """One dict per sample (or its error instance, which fails that row alone); `path`: a proxy directory (default:
    the shipped one). The proxy (and torch) is imported here, not when the registry is (`omniroll --help` stays
    light)."""
    from omniroll.models.shapes_proxy import WEIGHTS, load_proxy

    out: list = [None] * len(samples)
    rows, pictures, prompts = [], [], []
    for i, s in enumerate(samples):
        if s.is_video:
            out[i] = ValueError(f"sample {s.sample_id!r} is a video; the shapes proxy scores images")
            continue
        if s.image.shape[1:] != (SIZE, SIZE):
            out[i] = ValueError(f"sample {s.sample_id!r}: the shapes proxy scores {SIZE} x {SIZE} pictures, got "
                                f"{s.image.shape[1]} x {s.image.shape[2]}")
            continue
        try:
            spec = parse_prompt(s.prompt)
        except PromptError as e:
            out[i] = e
            continue
        rows.append((i, spec.tag))
        pictures.append(s.hwc())
        prompts.append(spec.prompt)
    if rows:
        probs = load_proxy(path or WEIGHTS).scores(np.stack(pictures), prompts)
        for (i, tag), p in zip(rows, probs):
            verdict = float(p >= 0.5)
            out[i] = {"score": float(p), "strict_pred": verdict, tag: verdict}
    return out


def shapes_proxy_factory(**kwargs):
    """The scorer for `reward.functions.<name>: {fn: shapes_proxy, kwargs: {path: DIR}}` (`path` optional; the proxy
    is loaded and its files checked here, before any sample)."""
    problems = check_kwargs(kwargs)
    if problems:
        raise ValueError("; ".join(problems))
    from omniroll.models.shapes_proxy import WEIGHTS, load_proxy

    where = os.path.abspath(kwargs["path"]) if kwargs.get("path") is not None else WEIGHTS
    load_proxy(where)

    def shapes_proxy(samples) -> list:
        return proxy_scores(samples, where)

    return shapes_proxy


def check_kwargs(kwargs: dict) -> list[str]:
    unknown = sorted(set(kwargs) - {"path"})
    if unknown:
        return [f"kwargs: the shapes proxy takes only `path` (a proxy directory), got {unknown}"]
    path = kwargs.get("path")
    if path is not None and (not isinstance(path, str) or not os.path.isdir(path)):
        return [f"kwargs.path: {path!r} is not a directory (expected a proxy directory: model.safetensors, "
                f"config.json, SHA256SUMS; `omniroll pretrain shapes-proxy --out DIR` writes DIR/weights)"]
    return []


shapes_proxy_factory.check_kwargs = check_kwargs
shapes_proxy_factory.check_prompts = grammar_problems

#: registry name -> factory (added to `omniroll.reward.scorers.SCORER_REGISTRY`)
SHAPES_PROXY_SCORERS = {"shapes_proxy": shapes_proxy_factory}
