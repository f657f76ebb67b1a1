"""benchmarks/reward_variance_steps.py's decomposition of the reward's variance into what a group shares (its initial
noise) and what one step's noise decides inside the group: hand-computed numbers, and a simulated reward whose two
parts are known."""

import random

import pytest

from benchmark_script import benchmark_script



@pytest.fixture(scope="module")
def script():
    with benchmark_script("reward_variance_steps") as mod:
        yield mod


def test_hand_computed_groups(script):
    # prompt a: sample variances 1/3 and 0 (within 1/6); group means 0.5 and 1 (variance 1/8, less 1/6 / 4 = 1/12)
    # prompt b: every reward 0. Pooled over the prompts as means; 3 of the 4 groups tie.
    d = script.decompose({"a": [[1, 1, 0, 0], [1, 1, 1, 1]], "b": [[0, 0], [0, 0]]})
    assert d["within"] == pytest.approx(1 / 12)
    assert d["between"] == pytest.approx(1 / 24)
    assert d["within_share"] == pytest.approx((1 / 12) / (1 / 12 + 1 / 24))
    assert d["tied_share"] == 0.75 and d["groups"] == 4


def test_a_simulated_reward_splits_into_its_known_parts(script):
    # R = (the group's initial-noise part, variance 1) + (the step's part, variance 0.25): 200 prompts x 10 groups x 8
    rng = random.Random(0)
    rewards = {f"p{p}": [[a + rng.gauss(0, 0.5) for _ in range(8)] for a in (rng.gauss(0, 1) for _ in range(10))]
               for p in range(200)}
    d = script.decompose(rewards)
    assert d["within"] == pytest.approx(0.25, rel=0.05)  # 14,000 degrees of freedom: a standard error of ~1.2 %
    assert d["between"] == pytest.approx(1.0, rel=0.1)  # 1,800 degrees of freedom: ~3.3 %
    assert d["tied_share"] == 0.0
