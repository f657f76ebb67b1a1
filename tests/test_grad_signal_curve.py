"""benchmarks/grad_signal.py's two cosine curves on gradients whose parts are known: the same prompts in both batches
count a prompt's own direction as signal; other prompts count only the direction every prompt shares."""

import random

import pytest
import torch

from benchmark_script import benchmark_script

DIM, PROMPTS, N = 4096, 32, 8


@pytest.fixture(scope="module")
def script():
    with benchmark_script("grad_signal") as mod:
        yield mod


def batches(shared: float, own: float, seed: int = 0) -> list[dict]:
    """Two batches of per-prompt group gradients: shared * c (every prompt) + own * mu_u (prompt u's alone, the same
    in both batches) + fresh noise of norm 1 in each batch."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda: torch.nn.functional.normalize(torch.randn(DIM, generator=g), dim=0)  # noqa: E731
    c, mu = unit(), {u: unit() for u in range(PROMPTS)}
    return [{u: shared * c + own * mu[u] + unit() for u in range(PROMPTS)} for _ in range(2)]


def means(curve):
    return {c["samples"]: c["cos_mean"] for c in curve}


def test_own_direction_is_signal_only_for_the_same_prompts(script):
    grads, common = batches(shared=0.0, own=3.0), list(range(PROMPTS))
    same = means(script.cosine_curve(grads, common, N, [8, 64, 128], 50, random.Random(0), other_prompts=False))
    other = means(script.cosine_curve(grads, common, N, [8, 64, 128], 50, random.Random(0), other_prompts=True))
    assert same[8] > 0.8 and same[128] > 0.8  # 9 of signal against 1 of noise per prompt
    assert all(abs(v) < 0.1 for v in other.values())  # nothing shared: other prompts' directions are unrelated


def test_shared_direction_is_signal_for_both(script):
    grads, common = batches(shared=1.0, own=0.0), list(range(PROMPTS))
    same = means(script.cosine_curve(grads, common, N, [8, 128], 50, random.Random(0), other_prompts=False))
    other = means(script.cosine_curve(grads, common, N, [8, 128], 50, random.Random(0), other_prompts=True))
    for curve in (same, other):
        assert 0.35 < curve[8] < 0.65  # E cos = 1 / (1 + 1) for one prompt a side
        assert curve[128] > 0.9  # 16 prompts a side: 16 / 17
    assert abs(same[8] - other[8]) < 0.15


def test_other_prompts_stop_at_half_the_prompts(script):
    grads, common = batches(shared=1.0, own=1.0), list(range(PROMPTS))
    other = script.cosine_curve(grads, common, N, [8, 128, 136, 256], 5, random.Random(0), other_prompts=True)
    same = script.cosine_curve(grads, common, N, [8, 128, 136, 256], 5, random.Random(0), other_prompts=False)
    assert [c["samples"] for c in other] == [8, 128]  # 17 or 32 prompts a side do not fit twice in 32
    assert [c["samples"] for c in same] == [8, 128, 136, 256]
    assert same[-1]["subsets"] == 1  # every prompt: one reading
