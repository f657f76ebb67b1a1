"""Reward data contract, builtin JPEG scorers, `load_function` and the scorer registry."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image


from omniroll.reward import (
    SCORER_REGISTRY,
    RewardResult,
    RewardSample,
    build_scorer,
    jpeg_compressibility,
    jpeg_incompressibility,
    load_function,
    register_scorer,
)
from tests.reward_fns import make_image


def _noise(seed: int, h: int = 32, w: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (3, h, w), dtype=np.uint8)


def _sample(i: int, image=None, prompt="a cat") -> RewardSample:
    return RewardSample(f"s{i}", _noise(i) if image is None else image, prompt)


# --------------------------------------------------------------------------------------------------- contract
def test_sample_validation_names_the_field():
    with pytest.raises(ValueError, match=r"image must be CHW with shape \[3, H, W\]"):
        RewardSample("a", np.zeros((8, 8, 3), np.uint8), "p")
    with pytest.raises(ValueError, match="image must have dtype uint8"):
        RewardSample("a", np.zeros((3, 8, 8), np.float32), "p")
    with pytest.raises(TypeError, match="image must be a numpy.ndarray"):
        RewardSample("a", [[0]], "p")
    with pytest.raises(ValueError, match="sample_id must be a non-empty str"):
        RewardSample("", make_image(0), "p")
    s = RewardSample("a", _noise(0, 5, 7), "p")
    assert s.hwc().shape == (5, 7, 3) and s.hwc().flags.c_contiguous
    assert s.extra_info == {} and s.data_source == "" and s.ground_truth is None


def test_result_status_invariants():
    with pytest.raises(ValueError, match="status must be one of"):
        RewardResult("a", 1.0, status="weird")
    with pytest.raises(ValueError, match="score must be None"):
        RewardResult("a", 0.0, status="failed")
    with pytest.raises(ValueError, match="finite float"):
        RewardResult("a", None, status="ok")
    with pytest.raises(ValueError, match="finite float"):
        RewardResult("a", float("nan"), status="flagged")
    r = RewardResult("a", 1.5, started_at=1.0, finished_at=3.0)
    assert r.ok and r.latency_s == 2.0 and r.to_dict()["score"] == 1.5


# ------------------------------------------------------------------------------------------------------- JPEG
def test_jpeg_scores_match_hand_computation():
    samples = [_sample(0), _sample(1), _sample(2, image=make_image(128, 32, 32))]
    expected_kb = []
    for s in samples:
        buf = io.BytesIO()
        Image.fromarray(s.image.transpose(1, 2, 0)).save(buf, format="JPEG", quality=95)
        expected_kb.append(len(buf.getvalue()) / 1000)
    inc = jpeg_incompressibility(samples)
    comp = jpeg_compressibility(samples)
    assert inc == pytest.approx(expected_kb, rel=0, abs=1e-12)
    assert comp == pytest.approx([-kb / 500 for kb in expected_kb], rel=0, abs=1e-12)
    # a flat image compresses far better than noise: higher compressibility, lower incompressibility
    assert comp[2] > comp[0] and inc[2] < inc[0]
    assert all(c <= 0 for c in comp)


# -------------------------------------------------------------------------------------------- user functions
def test_load_function_and_clear_errors():
    fn = load_function("tests.reward_fns:mean_pixel")
    assert fn([_sample(0, make_image(51))]) == [pytest.approx(0.2)]
    per = load_function("tests.reward_fns:sample_brightness", per_sample=True)
    assert per([_sample(0, make_image(51)), _sample(1, make_image(102))]) == pytest.approx([0.2, 0.4])
    method = load_function("tests.reward_fns:FailNTimes.__call__")
    assert callable(method)

    with pytest.raises(ValueError, match="module 'tests.no_such_module' not found"):
        load_function("tests.no_such_module:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing_fn'"):
        load_function("tests.reward_fns:missing_fn")
    with pytest.raises(ValueError, match="not callable"):
        load_function("tests.reward_fns:NOT_CALLABLE")
    with pytest.raises(ValueError, match="must be 'module:function'"):
        load_function("tests.reward_fns.mean_pixel")
    with pytest.raises(ValueError, match="both parts non-empty"):
        load_function("tests.reward_fns:")


def test_per_sample_async_runs_concurrently():
    fn = load_function("tests.reward_fns:async_prompt_len", per_sample=True)
    out = asyncio.run(fn([_sample(0, prompt="ab"), _sample(1, prompt="abcd")]))
    assert out == [2.0, 4.0]


# ------------------------------------------------------------------------------------------------- registry
def test_build_scorer_registry_and_user_functions():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "http"} <= set(SCORER_REGISTRY)
    assert build_scorer("jpeg_compressibility") is jpeg_compressibility
    with pytest.raises(ValueError, match="takes no kwargs"):
        build_scorer("jpeg_compressibility", {"quality": 80})
    with pytest.raises(ValueError, match="unknown reward fn 'no_such_scorer'.*jpeg_compressibility"):
        build_scorer("no_such_scorer")
    with pytest.raises(ValueError, match="url must start with http"):
        build_scorer("http", {"url": "ftp://x"})
    with pytest.raises(TypeError, match="must be a str or a callable"):
        build_scorer(3.0)

    scaled = build_scorer("tests.reward_fns:scaled", {"factor": 2.0})  # kwargs bound as keyword arguments
    assert scaled([_sample(0, make_image(10))]) == [20.0]
    counter = build_scorer("tests.reward_fns:AsyncCounter", {"offset": 5.0})  # a class is instantiated
    assert asyncio.run(counter([_sample(0), _sample(1)])) == [5.0, 6.0]
    direct = build_scorer(lambda samples: [3.0] * len(samples))
    assert direct([_sample(0)]) == [3.0]


def test_register_scorer():
    name = "test_reward_scorers_const"
    register_scorer(name, lambda value=1.0: (lambda samples: [value] * len(samples)))
    try:
        assert build_scorer(name, {"value": 7.0})([_sample(0)]) == [7.0]
        with pytest.raises(ValueError, match="already registered"):
            register_scorer(name, lambda: None)
        with pytest.raises(ValueError, match="without ':'"):
            register_scorer("a:b", lambda: None)
    finally:
        SCORER_REGISTRY.pop(name, None)
