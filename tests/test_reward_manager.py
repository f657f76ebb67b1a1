"""RewardManager: weighted combination, retries, failure policy (never a silent 0), config validation."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError


from omniroll.reward import RewardConfig, RewardManager, RewardSample
from tests.reward_fns import make_image

FNS = "tests.reward_fns"


def _samples(values=(51, 102)):
    return [RewardSample(f"s{i}", make_image(v), f"prompt {i}") for i, v in enumerate(values)]


def _score(config, samples=None):
    manager = RewardManager(config)
    return manager, asyncio.run(manager.score(_samples() if samples is None else samples))


def test_weighted_sum_of_two_functions():
    _, results = _score({
        "const": {"fn": f"{FNS}:const_one", "weight": 0.5},
        "bright": {"fn": f"{FNS}:mean_pixel", "weight": 1.0},
    })
    assert [r.sample_id for r in results] == ["s0", "s1"]
    for r, mean in zip(results, (0.2, 0.4)):
        assert r.status == "ok" and r.error is None
        assert r.components == {"const": 1.0, "bright": pytest.approx(mean)}
        assert r.score == pytest.approx(0.5 * 1.0 + 1.0 * mean)
        assert r.extra_info["const/attempts"] == 1 and "reward/missing" not in r.extra_info
        assert r.started_at <= r.finished_at


def test_builtin_jpeg_and_negative_weight():
    _, results = _score({"jpeg": {"fn": "jpeg_incompressibility", "weight": -2.0}})
    assert results[0].score == pytest.approx(-2.0 * results[0].components["jpeg"])
    assert results[0].components["jpeg"] > 0


def test_fails_twice_then_succeeds_with_two_retries():
    _, results = _score({"flaky": {"fn": f"{FNS}:FailNTimes", "kwargs": {"failures": 2}, "max_retries": 2}})
    for r in results:
        assert r.status == "ok" and r.score == 2.0
        assert r.extra_info["flaky/attempts"] == 3 and "flaky/error" not in r.extra_info


def test_retries_are_bounded():
    _, results = _score({"flaky": {"fn": f"{FNS}:FailNTimes", "kwargs": {"failures": 2}, "max_retries": 1}})
    for r in results:
        assert r.status == "failed" and r.score is None
        assert r.extra_info["flaky/attempts"] == 2
        assert "transient failure 2" in r.error and "flaky" in r.error


def test_required_failure_fails_the_row():
    _, results = _score({
        "good": {"fn": f"{FNS}:const_one"},
        "bad": {"fn": f"{FNS}:always_fail", "required": True, "max_retries": 1},
    })
    for r in results:
        assert r.status == "failed" and r.score is None
        assert "bad" in r.error and "scorer exploded" in r.error
        assert r.components == {"good": 1.0, "bad": None}
        assert r.extra_info["bad/attempts"] == 2
        assert "RuntimeError: scorer exploded" in r.extra_info["bad/error"]


def test_optional_failure_flags_the_row_and_never_scores_zero():
    _, results = _score({
        "good": {"fn": f"{FNS}:mean_pixel", "weight": 2.0},
        "bad": {"fn": f"{FNS}:always_fail", "weight": 1.0, "required": False, "max_retries": 0},
    })
    for r, mean in zip(results, (0.2, 0.4)):
        assert r.status == "flagged" and r.error is None
        assert r.components["bad"] is None  # not 0
        assert r.extra_info["reward/missing"] == ["bad"]
        assert "scorer exploded" in r.extra_info["bad/error"]
        assert r.score == pytest.approx(2.0 * mean)  # weights are not renormalized


def test_every_function_failing_is_a_failure_even_when_optional():
    _, results = _score({"bad": {"fn": f"{FNS}:always_fail", "required": False, "max_retries": 0}})
    assert all(r.status == "failed" and r.score is None for r in results)
    assert "every reward function failed" in results[0].error


@pytest.mark.parametrize(
    "fn, message",
    [("returns_nan", "non-finite score (nan)"), ("wrong_length", "returned 3 values for 2 samples"),
     ("returns_string", "returned a str, expected a number")],
)
def test_invalid_outputs_count_as_failures(fn, message):
    _, results = _score({"x": {"fn": f"{FNS}:{fn}", "max_retries": 1}})
    for r in results:
        assert r.status == "failed" and r.score is None
        assert message in r.extra_info["x/error"] and r.extra_info["x/attempts"] == 2


def test_only_failed_rows_are_retried():
    manager, results = _score({"odd": {"fn": f"{FNS}:NanOnOddFirstTime", "max_retries": 1}},
                              _samples((1, 2, 3, 4)))
    assert manager.fns["odd"].seen == [4, 2]
    assert [r.score for r in results] == [1.0, 2.0, 3.0, 4.0]
    assert all(r.status == "ok" for r in results)


def test_async_and_per_sample_user_functions():
    _, results = _score({
        "amean": {"fn": f"{FNS}:async_mean_pixel"},
        "plen": {"fn": f"{FNS}:async_prompt_len", "per_sample": True, "weight": 0.0},
        "bright": {"fn": f"{FNS}:sample_brightness", "per_sample": True, "weight": 0.0},
        "counter": {"fn": f"{FNS}:AsyncCounter", "kwargs": {"offset": 10.0}, "weight": 0.0},
        "np": {"fn": f"{FNS}:numpy_scores", "weight": 0.0},
    })
    assert results[0].components == {"amean": pytest.approx(0.2), "plen": 8.0, "bright": pytest.approx(0.2),
                                     "counter": 10.0, "np": 0.0}
    assert results[1].components["counter"] == 11.0 and results[1].components["np"] == 1.0
    assert [r.score for r in results] == [pytest.approx(0.2), pytest.approx(0.4)]


def test_dict_outputs_land_in_extra_info():
    _, results = _score({"d": {"fn": f"{FNS}:with_details"}})
    assert results[1].score == 0.25 and results[1].extra_info["d/label"] == "row-s1"


def test_functions_run_concurrently():
    t0 = time.perf_counter()
    _, results = _score({"a": {"fn": f"{FNS}:slow_sync", "kwargs": {"delay": 0.3}},
                         "b": {"fn": f"{FNS}:slow_sync", "kwargs": {"delay": 0.3}}})
    assert time.perf_counter() - t0 < 0.55  # 2 x 0.3 s in parallel threads
    assert all(r.score == 2.0 for r in results)


def test_timeout_is_a_failure():
    _, results = _score({"slow": {"fn": f"{FNS}:slow_async", "timeout_s": 0.05, "max_retries": 1},
                         "ok": {"fn": f"{FNS}:const_one"}})
    assert all(r.status == "failed" for r in results)
    assert "timed out after 0.05s" in results[0].extra_info["slow/error"]


def test_the_total_deadline_ends_retries_and_backoffs_together():
    """A function that answers after 1 s, given 0.3 s an attempt and 3 retries, fails its rows at its 0.5 s total
    deadline (one attempt cut at 0.3 s, the second at the deadline), the error naming the key; the other function's
    component is kept on the same rows."""
    t0 = time.perf_counter()
    _, results = _score({"slow": {"fn": f"{FNS}:slow_async", "timeout_s": 0.3, "max_retries": 3, "deadline_s": 0.5,
                                  "required": False},
                         "ok": {"fn": f"{FNS}:const_one"}})
    assert time.perf_counter() - t0 < 0.9
    for r in results:
        assert r.status == "flagged" and r.score == 1.0 and r.extra_info["slow/attempts"] == 2
        assert r.extra_info["slow/error"].startswith("no answer within the total deadline of 0.5 s "
                                                     "(reward.functions.slow.deadline_s")
    _, results = _score({"down": {"fn": f"{FNS}:always_fail", "max_retries": 5, "retry_backoff_s": 0.2,
                                  "deadline_s": 0.5}})
    assert results[0].extra_info["down/attempts"] == 2  # a third attempt's backoff (0.4 s) would end past 0.5 s
    assert "(no time for a retry within the total deadline of 0.5 s" in results[0].error


def test_empty_batch_and_bad_samples():
    manager = RewardManager({"c": {"fn": f"{FNS}:const_one"}})
    assert asyncio.run(manager.score([])) == []
    with pytest.raises(TypeError, match=r"samples\[0\] must be a RewardSample"):
        asyncio.run(manager.score([{"image": None}]))


# --------------------------------------------------------------------------------------------------- config
def test_config_forms():
    full = RewardConfig.from_any({"functions": {"a": {"fn": "jpeg_compressibility"}}, "max_wait_ms": 2})
    assert full.max_wait_ms == 2 and full.functions["a"].weight == 1.0
    listed = RewardConfig.from_any([{"name": "a", "fn": "jpeg_compressibility", "weight": 0.3}])
    assert listed.functions["a"].weight == 0.3 and listed.max_batch_size == 16
    assert RewardConfig.from_any(listed) is listed


@pytest.mark.parametrize(
    "config, pattern",
    [
        ({}, r"functions\n  Dictionary should have at least 1 item"),
        ([], r"functions\n  Dictionary should have at least 1 item"),
        ({"a": {"fn": "jpeg_compressibility", "wieght": 1.0}}, r"functions\.a\.wieght\n  Extra inputs"),
        ({"a": {"fn": "jpeg_compressibility", "max_retries": 11}}, r"functions\.a\.max_retries\n.*less than or "
                                                                    r"equal to 10"),
        ({"a": {"fn": "jpeg_compressibility", "weight": float("nan")}}, r"functions\.a\.weight\n.*finite number"),
        ({"a": {"fn": "jpeg_compressibility", "timeout_s": 0}}, r"functions\.a\.timeout_s\n.*greater than 0"),
        ({"a": {"fn": "jpeg_compressibility", "deadline_s": 0}}, r"functions\.a\.deadline_s\n.*greater than 0"),
        ({"a": {"fn": "http", "kwargs": {"url": "http://127.0.0.1:1/x", "deadline_s": 300}}},
         r"functions\.a\n.*kwargs\.deadline_s=300 \(the http scorer's own deadline\) is past deadline_s=120"),
        ({"a": {"weight": 1.0}}, r"functions\.a\.fn\n  Field required"),
        ({"a": {"fn": "  "}}, r"functions\.a\.fn\n.*non-empty"),
        ({"a/b": {"fn": "jpeg_compressibility"}}, r"function name 'a/b' must match"),
        ({"functions": {"a": {"fn": "jpeg_compressibility"}}, "max_batch_size": 0}, r"max_batch_size\n.*greater"),
    ],
)
def test_config_errors_name_the_field(config, pattern):
    with pytest.raises(ValidationError, match=pattern):
        RewardManager(config)


def test_config_errors_outside_pydantic():
    with pytest.raises(ValueError, match="duplicate function name 'a'"):
        RewardConfig.from_any([{"name": "a", "fn": "x:y"}, {"name": "a", "fn": "x:y"}])
    with pytest.raises(ValueError, match="list item 0 must be a dict with a str 'name'"):
        RewardConfig.from_any([{"fn": "x:y"}])
    with pytest.raises(TypeError, match="must be a RewardConfig, dict or list"):
        RewardConfig.from_any("jpeg")
    # checked by the config itself, before any scorer is built
    with pytest.raises(ValidationError, match=r"functions\.u\n.*fn: .*module 'tests.nope' not found"):
        RewardManager({"u": {"fn": "tests.nope:fn"}})
    with pytest.raises(ValidationError, match=r"functions\.j\n.*kwargs: .*takes no kwargs"):
        RewardManager({"j": {"fn": "jpeg_compressibility", "kwargs": {"q": 1}}})


def test_non_finite_weighted_sum_fails_the_row():
    _, results = _score({"h": {"fn": f"{FNS}:huge", "weight": 1e6}})
    assert all(r.status == "failed" and r.score is None for r in results)
    assert "not finite" in results[0].error and results[0].components["h"] == 1e308
