"""`reward.held_out`: functions scored at validation only, never on a training sample, logged
beside the trained reward; the paired decision that warns when the trained reward rises while a held-out one falls
(fires on a constructed pair of validations, not on noise), and the warning in a real run's step line."""

from __future__ import annotations

import json
import math
import os
import random

import pytest

from omniroll.config import ConfigError, load_config
from omniroll.evaluation.paired import paired_z
from omniroll.train.report.held_out import MIN_PAIRS, divergence, warning_text


def test_paired_z_by_hand():
    # d = [1, 2, 3]: mean 2, sample std 1, z = 2 / (1 / sqrt 3)
    assert paired_z([0.0, 0.0, 0.0], [1.0, 2.0, 3.0]) == pytest.approx(2 * math.sqrt(3))
    assert paired_z([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert paired_z([1.0, 2.0], [0.5, 1.5]) == -math.inf  # every sample fell by the same amount
    with pytest.raises(ValueError, match="same samples"):
        paired_z([1.0], [1.0, 2.0])


def test_divergence_fires_on_a_constructed_pair_of_validations():
    rng = random.Random(0)
    n = 8
    prev_t = [rng.random() for _ in range(n)]
    last_t = [v + 0.3 + 0.05 * rng.random() for v in prev_t]  # every sample's trained reward rose
    prev_h = [rng.random() for _ in range(n)]
    last_h = [v - 0.2 - 0.05 * rng.random() for v in prev_h]  # every sample's held-out reward fell
    steady = [v + 0.01 * (-1) ** i for i, v in enumerate(prev_h)]  # a held-out reward that did not move
    found = divergence((prev_t, last_t), {"falls": (prev_h, last_h), "steady": (prev_h, steady)})
    assert [d.name for d in found if d.falling] == ["falls"]
    assert found[0].trained_z > 2 and found[0].held_out_z < -2 and found[0].pairs == n
    assert abs(found[1].held_out_z) < 2
    assert warning_text(found).startswith("held-out falling: falls (trained z +")
    # a rising held-out reward is no warning; neither is a held-out fall while the trained reward does not rise
    assert not divergence((prev_t, last_t), {"h": (last_h, prev_h)})[0].falling
    assert not divergence((prev_t, prev_t), {"h": (prev_h, last_h)})[0].falling


def test_divergence_needs_enough_pairs_and_leaves_failed_samples_out():
    prev_t, last_t = [0.0] * 8, [1.0 + 0.01 * i for i in range(8)]
    prev_h, last_h = [1.0] * 8, [0.0 - 0.01 * i for i in range(8)]
    assert divergence((prev_t, last_t), {"h": (prev_h, last_h)})[0].falling
    few = divergence((prev_t[:MIN_PAIRS - 1], last_t[:MIN_PAIRS - 1]), {"h": (prev_h[:MIN_PAIRS - 1],
                                                                            last_h[:MIN_PAIRS - 1])})[0]
    assert not few.falling and few.pairs == MIN_PAIRS - 1
    holes = [None, None, None] + last_h[3:]  # three samples the held-out function could not score: left out
    d = divergence((prev_t, last_t), {"h": (prev_h, holes)})[0]
    assert d.pairs == 5 and not d.falling
    with pytest.raises(ValueError, match="different samples"):
        divergence((prev_t, last_t), {"h": (prev_h, last_h[:4])})


@pytest.mark.parametrize("n", [6, 16, 64])
def test_divergence_stays_quiet_on_noise(n):
    # two validations whose per-sample changes are pure noise (each reward's own scale, correlated or not):
    # across 2000 draws the warning may fire by chance only rarely (both sides must pass |z| >= 2)
    rng = random.Random(1234 + n)
    fired = 0
    for trial in range(2000):
        prev_t = [rng.random() for _ in range(n)]
        prev_h = [rng.random() for _ in range(n)]
        noise = [rng.gauss(0, 0.1) for _ in range(n)]
        last_t = [v + e for v, e in zip(prev_t, noise)]
        last_h = [v + (-e if trial % 2 else rng.gauss(0, 0.1)) for v, e in zip(prev_h, noise)]  # anti-correlated half
        fired += divergence((prev_t, last_t), {"h": (prev_h, last_h)})[0].falling
    # anti-correlated noise fires when the trained z passes +2 (~5 % at most): half the draws, so <= ~2.5 % + margin
    assert fired / 2000 < 0.05


def test_held_out_config_names_the_field():
    fns = {"colour": {"fn": "prompt_colour"}}
    with pytest.raises(ConfigError, match=r"reward\.held_out: 'colour' is also in reward\.functions"):
        load_config({"reward": {"functions": fns, "held_out": {"colour": {"fn": "jpeg_compressibility"}}}})
    with pytest.raises(ConfigError, match=r"reward\.held_out\.j\.fn: unknown reward function 'nope'"):
        load_config({"reward": {"functions": fns, "held_out": {"j": {"fn": "nope"}}}})
    cfg = load_config({"reward": {"functions": fns, "held_out": {"j": {"fn": "jpeg_compressibility"}}}})
    assert list(cfg.reward.held_out) == ["j"] and "held_out" not in cfg.reward.worker_config()


def test_held_out_is_scored_at_validation_only_and_warns_in_the_step_line(ray_cluster, tiny_sd3_path, tmp_path):
    from omniroll.train import Trainer

    seen = tmp_path / "held_out_saw.txt"
    cfg = load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": tiny_sd3_path, "max_batch_size": 16, "num_threads": 1},
        "pipeline": {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5,
                     "max_sequence_length": 8},
        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [0, 3]},
        "agent": {"num_workers": 1},
        # trained: the colour reward plus the clock on validation rows (rises between validations, whatever the
        # pictures); held out: minus the clock (falls), recording every sample it scores
        "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"},
                                                   "clock": {"fn": "tests.reward_fns:val_clock"}},
                   "held_out": {"minus_clock": {"fn": "tests.reward_fns:MinusClockRecorder",
                                                "kwargs": {"path": str(seen)}}}},
        "n": 4, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 3},
        "trainer": {"prompts": ["a blue car", "a green bird"], "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 8, "steps": 2, "val_every": 1, "num_threads": 1, "checkpoint_every": 0},
    })
    out = str(tmp_path / "run")
    lines: list[str] = []
    with Trainer(cfg, out, log=lines.append) as tr:
        hist = tr.train()
    # scored on the 3 validations' 6 pictures each (2 prompts x val_kwargs.n 3), never on a training sample
    saw = seen.read_text().split("\n")[:-1]
    assert len(saw) == 3 * 6 and {s.split()[0] for s in saw} == {"val"}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    held = [r for r in records if "validation" in r]
    assert [r["validation"] for r in held] == ["before", "step000001", "after"]
    assert all(r["val/held_out/minus_clock/failed"] == 0.0 and r["val/held_out/minus_clock/score"] < 0 for r in held)
    assert "val/held_out/minus_clock/z" not in held[0]  # nothing to compare the first validation with
    for r in held[1:]:
        assert r["val/held_out/minus_clock/falling"] == 1.0 and r["val/held_out/trained_z"] >= 2
        assert r["val/held_out/minus_clock/z"] <= -2
    # the warning: in the validation's lines, then in the next step's line and record
    assert any(line.startswith("WARNING held-out falling: minus_clock") for line in lines)
    assert "held_out_warning" not in hist[0] and hist[1]["held_out_warning"].startswith("held-out falling: minus")
    step2 = [line for line in lines if line.startswith("step    2/2")]
    assert len(step2) == 1 and "WARNING held-out falling: minus_clock" in step2[0]
    with open(os.path.join(out, "validation.jsonl")) as f:
        vals = [json.loads(line) for line in f if line.strip()]
    assert [len(v["held_out/rows"]["minus_clock"]) for v in vals] == [6, 6, 6]


class _Batch:
    """What `HeldOutRewards.observe` reads of a validation batch: the pictures, their ids and prompts, and each
    picture's trained reward (`reward_extra_info`)."""

    def __init__(self, values: list[int], trained: list[float]):
        import numpy as np
        import torch

        n = len(values)
        self.batch = {"responses": torch.stack([torch.full((3, 8, 8), v, dtype=torch.uint8) for v in values])}
        self.non_tensor_batch = {"request_id": np.array([f"val-{i}" for i in range(n)], dtype=object),
                                 "raw_prompt": np.array(["x"] * n, dtype=object),
                                 "reward_extra_info": np.array([{"score": t} for t in trained], dtype=object)}

    def __len__(self):
        return len(self.batch["responses"])


class _Tracker:
    def __init__(self):
        self.logged = []

    def log_held_out(self, tag, step, metrics):
        self.logged.append((tag, step, metrics))


def test_a_proxy_that_peaked_and_turned_is_caught_since_the_start(tmp_path):
    """The 96-step hacking run's shape: the trained reward rises, then falls a little while the held-out judge
    collapses. Between the last two validations both fall (no warning there); since the first validation the trained
    reward stands detectably up and the judge detectably down: the warning fires, says so, and the step record
    carries it. A resumed run compares with the same first validation (read back from validation.jsonl)."""
    from omniroll.train.report.held_out import HeldOutRewards

    n = 12
    noise = [0.01 * ((7 * i) % 5 - 2) for i in range(n)]  # per-sample spread, so the paired z is finite
    start = _Batch([100 + (i % 3) for i in range(n)], [0.3 + e for e in noise])
    peak = _Batch([120 + (i % 3) for i in range(n)], [0.8 + e for e in reversed(noise)])
    turned = _Batch([20 + (i % 5) for i in range(n)], [0.6 + e for e in noise])
    held = HeldOutRewards({"judge": {"fn": "tests.reward_fns:mean_pixel"}}, str(tmp_path))
    tracker, lines, records = _Tracker(), [], []
    for step, (tag, batch) in enumerate((("before", start), ("step1", peak), ("after", turned))):
        records.append(held.observe(batch, tag, step, tracker, lines.append))
        with open(tmp_path / "validation.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "tag": tag, "held_out/rows": records[-1]["held_out/rows"]}) + "\n")
    second, last = records[1], records[2]
    assert second["val/held_out/judge/falling"] == 0.0 and "val/held_out/judge/z_start" not in second
    assert last["val/held_out/trained_z"] <= -2 and last["val/held_out/judge/z"] <= -2  # both fell: no warning here
    assert last["val/held_out/trained_z_start"] >= 2 and last["val/held_out/judge/z_start"] <= -2
    assert last["val/held_out/judge/falling"] == 1.0
    assert held.step_metrics()["held_out_warning"].startswith("held-out falling: judge (trained z +")
    assert held.step_metrics()["held_out_warning"].endswith("since the start")
    assert any(line.startswith("WARNING held-out falling: judge") and "since the first validation" in line
               for line in lines)
    resumed = HeldOutRewards({"judge": {"fn": "tests.reward_fns:mean_pixel"}}, str(tmp_path))
    again = resumed.observe(turned, "after", 3, _Tracker(), lambda s: None)
    assert again["val/held_out/judge/z"] == 0.0 and again["val/held_out/judge/falling"] == 1.0  # vs the first
