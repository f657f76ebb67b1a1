"""The learning-signal check (`omniroll.train.report.signal_check`) on step metrics: the tied-groups and reward-drop
warnings come once per episode, the drop is measured in the reward's own spread (any sign, any scale), every group tied
for N steps stops with `NoLearningSignal` naming the metrics, the causes and what to change; the config keys are
validated. The trainer and CLI side (checkpoint, exit 1, one line per problem): tests/test_train_report.py."""

import pytest

from omniroll.config import ConfigError, SignalCheckSection, load_config
from omniroll.train import LearningSignalCheck, NoLearningSignal


def step(i, tied, groups=4, mean=0.5, std=0.1):
    return {"step": i, "tied_groups": tied, "num_groups": groups, "reward_mean": mean, "reward_std": std}


def check(**settings):
    lines = []
    return LearningSignalCheck(SignalCheckSection(**settings), lines.append, {"trainer.lr": 0.5, "n": 2}), lines


def test_the_tied_groups_warning_comes_once_per_episode():
    c, lines = check(tied_warn_frac=0.75, stop_after_tied_steps=0)
    for i, tied in enumerate([0, 3, 4, 3, 1, 3, 2], start=1):  # >= 3/4 at steps 2-4 and 6: two episodes
        c.observe(step(i, tied))
    assert [ln.split(":")[0] for ln in lines] == ["warning", "warning"]
    assert lines[0].startswith("warning: step 2: 3/4 prompt groups have tied rewards") and "step 6: 3/4" in lines[1]
    assert "learning rate too high" in lines[0] and "group size too small" in lines[0]


@pytest.mark.parametrize("scale, offset", [(1.0, 0.0), (1000.0, -5000.0), (1e-3, -1.0)])
def test_the_reward_drop_warning_is_in_the_rewards_own_spread_whatever_its_sign_and_scale(scale, offset):
    c, lines = check(stop_after_tied_steps=0, reward_window=2, reward_drop_stds=2.0)
    means = [0.50, 0.52, 0.49, 0.45, 0.20, 0.21, 0.50, 0.51, 0.20, 0.20]  # start 0.51 +- 0.1: below 0.31 is a drop
    for i, r in enumerate(means, start=1):
        c.observe(step(i, 0, mean=offset + scale * r, std=scale * 0.1))
    warned = [int(ln.split()[2].rstrip(":")) for ln in lines]
    # steps 5-6 average 0.205 (drop), then recover at 7-8, and fall again at 10 (0.20, 0.20): two episodes
    assert warned == [6, 10], lines
    assert "more than 2 x the standard error of that difference" in lines[0] and "learning rate too high" in lines[0]


def test_every_group_tied_for_n_steps_stops_naming_the_metrics_causes_and_fixes():
    c, lines = check(stop_after_tied_steps=3)
    for i, tied in enumerate([2, 4, 4, 1, 4, 4], start=1):  # step 4 breaks the streak: N consecutive all-tied steps
        c.observe(step(i, tied, mean=0.0, std=0.0))
    with pytest.raises(NoLearningSignal) as e:
        c.observe(step(7, 4, mean=0.0, std=0.0))
    what, cause, fix = e.value.problems
    assert "for 3 consecutive steps, 5-7: tied_groups/num_groups 4/4, 4/4, 4/4" in what
    assert "reward mean +- std +0 +- 0, +0 +- 0, +0 +- 0" in what
    assert "learning rate too high" in cause and "trainer.lr=0.5" in cause and "(n=2)" in cause
    assert "cannot tell the samples apart" in cause and "group size too small" in cause
    assert "lower trainer.lr" in fix and "raise n" in fix and "stop_after_tied_steps=0" in fix
    assert [m["step"] for m in e.value.steps] == [5, 6, 7] and str(e.value).count("\n") == 2
    assert len(lines) == 2  # the tied warning at steps 2 and 4 (two episodes), nothing more

    off, _ = check(stop_after_tied_steps=0)  # 0: never stops
    for i in range(1, 50):
        off.observe(step(i, 4, mean=0.0, std=0.0))


def test_a_resumed_run_measures_the_drop_from_its_first_steps():
    earlier = [step(i, 0, mean=1.0, std=0.1) for i in (1, 2, 3)]
    lines = []
    c = LearningSignalCheck(SignalCheckSection(reward_window=3), lines.append, earlier=earlier)
    for i in (4, 5, 6):
        c.observe(step(i, 0, mean=0.5))
    assert len(lines) == 1 and "steps 1-3 (+1)" in lines[0]


def test_the_signal_check_keys_are_validated_naming_the_key_and_range():
    base = {"reward": {"functions": {"c": {"fn": "prompt_colour"}}}, "n": 2,
            "trainer": {"prompts": ["a red car"], "prompts_per_step": 1}}
    cfg = load_config(base).trainer.signal_check
    assert (cfg.tied_warn_frac, cfg.stop_after_tied_steps, cfg.reward_window, cfg.reward_drop_stds) == (0.75, 5, 5, 3.0)
    for key, value, allowed in (("tied_warn_frac", 0, "greater than 0"), ("tied_warn_frac", 1.5, "less than or equal "
                                "to 1"), ("stop_after_tied_steps", -1, "greater than or equal to 0"),
                                ("reward_window", 0, "greater than or equal to 1"),
                                ("reward_drop_stds", 0, "greater than 0")):
        with pytest.raises(ConfigError, match=f"trainer.signal_check.{key}") as e:
            load_config({**base, "trainer": {**base["trainer"], "signal_check": {key: value}}})
        assert allowed in str(e.value)
    with pytest.raises(ConfigError, match="trainer.signal_check.bogus"):
        load_config({**base, "trainer": {**base["trainer"], "signal_check": {"bogus": 1}}})
    for field in SignalCheckSection.model_fields.values():
        assert field.description


def test_groups_solved_at_the_runs_best_reward_are_not_a_collapse():
    logs = []
    check = LearningSignalCheck(SignalCheckSection(tied_warn_frac=0.75, stop_after_tied_steps=2, reward_window=3,
                                                   reward_drop_stds=2.0), logs.append)
    check.observe({"step": 1, "reward_mean": 0.4, "reward_std": 0.3, "reward_max": 1.0, "tied_groups": 0,
                   "tied_rewards": [], "num_groups": 4})
    for step in (2, 3, 4):  # every group tied at 1.0, the best any sample had: learned, not collapsed
        check.observe({"step": step, "reward_mean": 1.0, "reward_std": 0.0, "reward_max": 1.0, "tied_groups": 4,
                       "tied_rewards": [1.0] * 4, "num_groups": 4})
    assert len(logs) == 1 and "4/4 prompt groups are solved" in logs[0] and "warning" not in logs[0]
    with pytest.raises(NoLearningSignal):  # tied at 0 below the best 1.0: the collapse the stop is for
        for step in (5, 6):
            check.observe({"step": step, "reward_mean": 0.0, "reward_std": 0.0, "reward_max": 0.0, "tied_groups": 4,
                           "tied_rewards": [0.0] * 4, "num_groups": 4})
    assert any(line.startswith("warning: step 5: 4/4 prompt groups have tied rewards below the best") for line in logs)


def test_a_steady_slide_of_a_widely_spread_reward_is_a_drop_and_its_usual_wobble_is_not():
    """The partial-credit reward of a run whose learning rate was too high (measured on the shapes world: lr 3e-3
    with three updates per batch): step means 0.6 -> 0.35 while each step's samples spread +- 0.3, which the old
    within-step-std test never flagged; and the same reward wobbling without a trend, which must stay quiet."""
    import math

    slide = [0.61, 0.60, 0.60, 0.51, 0.46, 0.60, 0.57, 0.63, 0.46, 0.57, 0.42, 0.46, 0.45, 0.29, 0.45, 0.32, 0.45,
             0.46, 0.29, 0.55, 0.42, 0.42, 0.38, 0.32, 0.41, 0.39, 0.36]
    c, lines = check(stop_after_tied_steps=0)
    for i, r in enumerate(slide, start=1):
        c.observe({**step(i, 0, mean=r, std=0.31), "num_samples": 48})
    assert len(lines) == 1 and lines[0].startswith("warning: step ")
    wobble = [0.55 + 0.08 * math.sin(1.7 * i) for i in range(60)]
    c, lines = check(stop_after_tied_steps=0)
    for i, r in enumerate(wobble, start=1):
        c.observe({**step(i, 0, mean=r, std=0.31), "num_samples": 48})
    assert lines == []


def meter_steps(cos, window, rows=24):
    from omniroll.train.grad_signal import SignalWindow, signal_metrics

    w = SignalWindow(window)
    return [{**step(i, 0), **w.metrics(signal_metrics(x, rows, rows))} for i, x in enumerate(cos, start=1)]


def test_the_gradient_noise_warning_reads_the_meter_once_per_episode():
    c, lines = check(stop_after_tied_steps=0, grad_cos_window=4, grad_cos_warn=0.05)
    cos = [0.01, -0.02, 0.0, 0.01,  # mean 0.0 +- 0.006: confidently below 0.05 at step 4
           0.02, 0.3, 0.4, 0.35,    # the halves agree again (steps 6-8): the episode ends
           0.0, 0.01, -0.01, 0.0]   # noise again at step 12
    for m in meter_steps(cos, 4):
        c.observe(m)
    noise = [ln for ln in lines if "mostly noise" in ln]
    assert [int(ln.split()[2].rstrip(":")) for ln in noise] == [4, 12], lines
    assert "at 24 samples per half" in noise[0] and "trainer.kl_beta" in noise[0] and "prompts_per_step" in noise[0]
    assert "benchmarks/grad_signal.py" in noise[0]


def test_a_meter_whose_noise_only_touches_the_threshold_is_one_episode_and_warns_once():
    """The demo's meter (AWM, 24 samples per half): about +0.02 +- 0.05 a reading, so the window's upper bound
    (mean + 2 se) crosses grad_cos_warn now and then while its mean never reaches it. That is one episode: one
    warning, not one each time the bound dips under the threshold again (it had said so 5 times in 24 steps)."""
    c, lines = check(stop_after_tied_steps=0, grad_cos_window=5, grad_cos_warn=0.05)
    cos = [-0.005, 0.064, -0.007, -0.05, -0.03,   # mean -0.006: warns at step 5
           0.09, 0.08, 0.07, -0.04, 0.01,         # mean +0.042 +- 0.025: the bound above 0.05, the mean below it
           -0.06, -0.08, -0.03, -0.02, -0.05,     # confidently below again: still the same episode
           0.04, 0.045, 0.03, 0.06, 0.02]         # mean +0.039 < 0.05
    steps = meter_steps(cos, 5)
    bounds = [m["grad_cos_mean"] + 2 * m["grad_cos_se"] for m in steps[4:]]
    assert any(b >= 0.05 for b in bounds) and any(b < 0.05 for b in bounds[5:])  # the bound does cross, both ways
    assert max(m["grad_cos_mean"] for m in steps[4:]) < 0.05
    for m in steps:
        c.observe(m)
    noise = [ln for ln in lines if "mostly noise" in ln]
    assert [int(ln.split()[2].rstrip(":")) for ln in noise] == [5], lines


def test_the_gradient_noise_warning_stays_quiet_while_the_halves_agree_or_the_meter_is_off():
    c, lines = check(stop_after_tied_steps=0, grad_cos_window=3)
    for m in meter_steps([0.2, 0.15, 0.25, 0.3, 0.1], 3):
        c.observe(m)
    for i in range(6, 12):  # steps the meter did not read carry no grad_cos
        c.observe(step(i, 0))
    assert lines == []
