"""The reward of benchmarks/train_step.py: prompt_colour plus an optional wait per sample (a remote scorer's latency).
Importable by the reward workers as `benchmarks_reward:delayed_colour` (train_step.py puts this directory on
PYTHONPATH)."""

import time

from omniroll.reward import prompt_colour


def delayed_colour(samples, delay_ms: float = 0.0):
    time.sleep(delay_ms / 1000.0 * len(samples))
    return prompt_colour(samples)
