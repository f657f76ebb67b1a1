"""Reward functions used by tests/test_reward*.py, loaded through `"tests.reward_fns:<name>"` (also inside Ray actors).

Stateful behaviours (fail N times, ...) are classes, so every RewardManager gets its own fresh instance.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np


def make_image(value: int, h: int = 16, w: int = 16) -> np.ndarray:
    return np.full((3, h, w), value, dtype=np.uint8)


def mean_pixel(samples):
    """Mean pixel value in [0, 1]."""
    return [float(s.image.mean()) / 255.0 for s in samples]


def const_one(samples):
    return [1.0] * len(samples)


def scaled(samples, factor=1.0):
    """kwargs are bound by build_scorer as keyword arguments."""
    return [factor * float(s.image.mean()) for s in samples]


async def async_mean_pixel(samples):
    await asyncio.sleep(0.001)
    return mean_pixel(samples)


def sample_brightness(sample):
    """Per-sample (per_sample=True) sync function."""
    return float(sample.image.mean()) / 255.0


async def async_prompt_len(sample):
    """Per-sample (per_sample=True) async function."""
    await asyncio.sleep(0.001)
    return float(len(sample.prompt))


def with_details(samples):
    return [{"score": 0.25, "label": f"row-{s.sample_id}"} for s in samples]


def always_fail(samples):
    raise RuntimeError("scorer exploded")


def returns_nan(samples):
    return [float("nan")] * len(samples)


def wrong_length(samples):
    return [1.0] * (len(samples) + 1)


def returns_string(samples):
    return ["high"] * len(samples)


def numpy_scores(samples):
    return np.arange(len(samples), dtype=np.float32)


def slow_sync(samples, delay=0.2):
    time.sleep(delay)
    return [1.0] * len(samples)


async def slow_async(samples, delay=1.0):
    await asyncio.sleep(delay)
    return [1.0] * len(samples)


class FailNTimes:
    """Raises on its first `failures` calls, then scores 2.0."""

    def __init__(self, failures: int = 2):
        self.failures = failures
        self.calls = 0

    def __call__(self, samples):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"transient failure {self.calls}")
        return [2.0] * len(samples)


class NanOnOddFirstTime:
    """First call: NaN for odd rows (by pixel value); later calls score every row. Records the batch sizes it saw."""

    def __init__(self):
        self.seen: list[int] = []

    def __call__(self, samples):
        first = not self.seen
        self.seen.append(len(samples))
        out = []
        for s in samples:
            v = int(s.image[0, 0, 0])
            out.append(float("nan") if first and v % 2 else float(v))
        return out


class AsyncCounter:
    """Async `__call__` on an instance (a stateful async scorer)."""

    def __init__(self, offset: float = 0.0):
        self.offset = offset

    async def __call__(self, samples):
        await asyncio.sleep(0)
        return [self.offset + i for i in range(len(samples))]


async def record_batch(samples):
    """Reports, on every row, the size of the batch it arrived in."""
    await asyncio.sleep(0.01)
    return [{"score": 1.0, "batch_size": len(samples)} for _ in samples]


NOT_CALLABLE = 42


def huge(samples):
    return [1e308] * len(samples)


def colour_channels(samples):
    """A scorer that returns dicts: a strict pass as the score (1.0 when the prompt's colour channel is the image's
    strongest, else 0.0) and, as extras, each channel's mean in [0, 1] (`red`, `green`, `blue`)."""
    from omniroll.reward.scorers import prompt_colour_name

    out = []
    for s in samples:
        means = {c: float(s.image[i].astype(np.float64).mean()) / 255.0 for i, c in enumerate(("red", "green", "blue"))}
        out.append({"score": float(max(means, key=means.get) == prompt_colour_name(s.prompt)), **means})
    return out


def val_clock(samples):
    """The wall clock on validation rows (`data_source` "val"), 0.0 on training rows: a trained reward that rises
    from one validation to the next whatever the pictures (tests/test_reward_held_out.py)."""
    return [time.time() if s.data_source == "val" else 0.0 for s in samples]


class MinusClockRecorder:
    """minus the wall clock, and appends each row's `data_source sample_id` to `path`: a held-out reward that falls
    from one validation to the next, and the record of every sample it ever scored."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, samples):
        with open(self.path, "a") as f:
            for s in samples:
                f.write(f"{s.data_source} {s.sample_id}\n")
        return [-time.time() + 1e-3 * i for i, _ in enumerate(samples)]


def fails_on_marked(samples):
    """0.5, except on a prompt holding "fail-me": that row's own error (an exception in its place)."""
    return [RuntimeError("this prompt is marked") if "fail-me" in s.prompt else 0.5 for s in samples]
