"""HttpScorer against a real FastAPI server (uvicorn in a background thread on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import collections
import socket
import time

import numpy as np
import pytest
from http_helpers import serving
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omniroll.reward import (
    HttpScorer,
    RewardHTTPError,
    RewardManager,
    RewardSample,
    decode_png_batch,
    decode_safetensors_batch,
)
from omniroll.reward.http import encode_safetensors_batch


def _mean_scores(images) -> list[float]:
    return [float(np.asarray(im).mean()) / 255.0 for im in images]


def _make_app(state: dict) -> FastAPI:
    app = FastAPI()
    hits = state["hits"]

    @app.post("/flaky/{key}")
    async def flaky(key: str, request: Request):
        hits[key] += 1
        if hits[key] == 1:
            return JSONResponse({"detail": "warming up"}, status_code=503)
        images, _, _ = decode_png_batch(await request.json())
        return {"scores": _mean_scores(images)}

    @app.post("/always500/{key}")
    async def always500(key: str):
        hits[key] += 1
        return JSONResponse({"detail": "model crashed"}, status_code=500)

    @app.post("/bad400/{key}")
    async def bad400(key: str):
        hits[key] += 1
        return JSONResponse({"detail": "bad image"}, status_code=400)

    @app.post("/score/{key}")
    async def score(key: str, request: Request):
        hits[key] += 1
        images, prompts, metadata = decode_png_batch(await request.json())
        state["batches"][key].append([m["sample_id"] for m in metadata])
        assert len(prompts) == len(images)
        return {"scores": _mean_scores(images)}

    @app.post("/st/{key}")
    async def st(key: str, request: Request):
        hits[key] += 1
        assert request.headers["content-type"] == "application/octet-stream"
        images, prompts, metadata = decode_safetensors_batch(await request.body())
        state["st"][key] = (images, prompts, metadata)
        return {"scores": [{"score": s, "n_prompt_chars": len(p)} for s, p in zip(_mean_scores(images), prompts)]}

    @app.post("/short/{key}")
    async def short(key: str, request: Request):
        hits[key] += 1
        images, _, _ = decode_png_batch(await request.json())
        return {"scores": _mean_scores(images)[:-1]}

    @app.post("/sleepy/{key}")
    async def sleepy(key: str):
        hits[key] += 1
        await asyncio.sleep(2.0)
        return {"scores": [1.0]}

    @app.post("/drip/{key}")
    async def drip(key: str):  # a server that answers one byte every 0.2 s: no single read ever times out
        hits[key] += 1

        async def body():
            yield b'{"scores": [1.0]'
            for _ in range(50):
                await asyncio.sleep(0.2)
                yield b" "
            yield b"}"

        return StreamingResponse(body(), media_type="application/json")

    @app.post("/hang/{key}")
    async def hang(key: str):  # never answers in time (at most 5 s, until the server stops: state["release"])
        hits[key] += 1
        for _ in range(100):
            if state["release"]:
                break
            await asyncio.sleep(0.05)
        return {"scores": [1.0]}

    @app.post("/hangon/{key}")
    async def hangon(key: str, request: Request):  # hangs on a batch holding the prompt "hang", scores the others
        hits[key] += 1
        images, prompts, _ = decode_png_batch(await request.json())
        for _ in range(100):  # at most 5 s, until the server stops (state["release"])
            if "hang" not in prompts or state["release"]:
                break
            await asyncio.sleep(0.05)
        return {"scores": _mean_scores(images)}

    @app.post("/notnumbers/{key}")
    async def notnumbers(key: str):
        hits[key] += 1
        return {"scores": [True, False, "0.5", {"score": True}, 0.25]}

    return app


@pytest.fixture(scope="module")
def server():
    state = {"hits": collections.Counter(), "batches": collections.defaultdict(list), "st": {}, "release": False}
    # at the end, requests still hanging answer, so the server stops at once
    with serving(_make_app(state), before_stop=lambda: state.update(release=True)) as url:
        yield url, state


def _samples(n: int, h: int = 8, w: int = 8) -> list[RewardSample]:
    return [RewardSample(f"s{i}", np.full((3, h, w), 10 * i, np.uint8), f"prompt number {i}",
                         data_source="unit", ground_truth={"i": i}, extra_info={"tag": np.int64(i)})
            for i in range(n)]


def _run(scorer, samples):
    async def go():
        try:
            return await scorer(samples)
        finally:
            await scorer.aclose()

    return asyncio.run(go())


def test_retries_after_503_then_succeeds(server):
    url, state = server
    scorer = HttpScorer(f"{url}/flaky/a", backoff_s=0.01, max_retries=3)
    out = _run(scorer, _samples(3))
    assert state["hits"]["a"] == 2 and scorer.requests_sent == 2
    assert [row["attempts"] for row in out] == [2, 2, 2]
    assert [row["score"] for row in out] == pytest.approx([0.0, 10 / 255, 20 / 255])


def test_always_500_raises_clear_error_after_max_retries(server):
    url, state = server
    scorer = HttpScorer(f"{url}/always500/b", backoff_s=0.01, max_retries=2)
    with pytest.raises(RewardHTTPError) as info:
        _run(scorer, _samples(2))
    err = info.value
    assert err.status == 500 and err.attempts == 3 and err.url == f"{url}/always500/b"
    assert f"POST {url}/always500/b failed after 3 attempt(s): status=500" in str(err)
    assert "model crashed" in str(err) and "max_retries=2 exhausted" in str(err)
    assert state["hits"]["b"] == 3


def test_client_error_is_not_retried(server):
    url, state = server
    with pytest.raises(RewardHTTPError, match=r"after 1 attempt\(s\): status=400.*not retried"):
        _run(HttpScorer(f"{url}/bad400/c", backoff_s=0.01, max_retries=3), _samples(1))
    assert state["hits"]["c"] == 1


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave the block: nothing listens there
    scorer = HttpScorer(f"http://127.0.0.1:{port}/x", backoff_s=0.01, max_retries=2)
    with pytest.raises(RewardHTTPError, match=r"after 3 attempt\(s\): status=None: connection error") as info:
        _run(scorer, _samples(1))
    assert info.value.status is None and info.value.attempts == 3


def test_timeout_is_retried_then_reported(server):
    url, state = server
    # an attempt long enough for the request to reach the server on a busy machine, far shorter than its answer
    scorer = HttpScorer(f"{url}/sleepy/d", timeout_s=0.5, backoff_s=0.01, max_retries=1)
    with pytest.raises(RewardHTTPError, match=r"after 2 attempt\(s\): status=None: timeout after 0.5s"):
        _run(scorer, _samples(1))
    assert state["hits"]["d"] == 2


def test_batching_splits_posts_and_keeps_order(server):
    url, state = server
    scorer = HttpScorer(f"{url}/score/e", batch_size=4)
    out = _run(scorer, _samples(10))
    assert state["hits"]["e"] == 3
    assert sorted(len(b) for b in state["batches"]["e"]) == [2, 4, 4]
    assert sorted(sum(state["batches"]["e"], [])) == sorted(f"s{i}" for i in range(10))
    assert [row["score"] for row in out] == pytest.approx([10 * i / 255 for i in range(10)])


def test_wrong_length_response_is_an_error(server):
    url, _ = server
    with pytest.raises(RewardHTTPError, match="response has 1 scores for a batch of 2"):
        _run(HttpScorer(f"{url}/short/f"), _samples(2))


def test_safetensors_round_trip(server):
    url, state = server
    rng = np.random.default_rng(0)
    samples = [RewardSample(f"t{i}", rng.integers(0, 256, (3, 12, 20), dtype=np.uint8), f"p{i}" * (i + 1),
                            ground_truth=[i, "x"]) for i in range(3)]
    out = _run(HttpScorer(f"{url}/st/g", encoding="safetensors"), samples)
    images, prompts, metadata = state["st"]["g"]
    assert images.dtype == np.uint8 and images.shape == (3, 3, 12, 20)
    np.testing.assert_array_equal(images, np.stack([s.image for s in samples]))
    assert prompts == [s.prompt for s in samples]
    assert [m["sample_id"] for m in metadata] == ["t0", "t1", "t2"] and metadata[2]["ground_truth"] == [2, "x"]
    assert [row["score"] for row in out] == pytest.approx(_mean_scores([s.image for s in samples]))
    assert [row["n_prompt_chars"] for row in out] == [2, 4, 6]


def test_safetensors_splits_mixed_resolutions_by_shape(server):
    url, state = server
    samples = [RewardSample(f"m{i}", np.full((3, 4 + 4 * (i % 2), 4), 5 * i, np.uint8), "") for i in range(5)]
    out = _run(HttpScorer(f"{url}/st/h", encoding="safetensors", batch_size=8), samples)
    assert state["hits"]["h"] == 2  # one request per image shape
    assert [row["score"] for row in out] == pytest.approx([5 * i / 255 for i in range(5)])
    with pytest.raises(ValueError, match="one image shape per batch"):
        encode_safetensors_batch(samples)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [({"timeout_s": 0}, r"timeout_s must be a number in"), ({"max_retries": -1}, r"max_retries must be an int in"),
     ({"batch_size": 0}, r"batch_size must be an int in \[1, 65536\]"),
     ({"encoding": "pickle"}, r"encoding must be one of")],
)
def test_constructor_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HttpScorer("http://127.0.0.1:1/x", **kwargs)


def test_manager_with_http_functions(server):
    url, _ = server
    config = {
        "remote": {"fn": "http", "kwargs": {"url": f"{url}/flaky/i", "backoff_s": 0.01}, "max_retries": 0},
        "down": {"fn": "http", "kwargs": {"url": f"{url}/always500/j", "backoff_s": 0.01, "max_retries": 1},
                 "required": False, "max_retries": 0},
    }
    manager = RewardManager(config)

    async def go():
        try:
            return await manager.score(_samples(2))
        finally:
            await manager.aclose()

    results = asyncio.run(go())
    for r, expected in zip(results, (0.0, 10 / 255)):
        assert r.status == "flagged" and r.components["down"] is None
        assert r.score == pytest.approx(expected)
        assert r.extra_info["remote/attempts"] == 2  # HTTP-level attempts reported per row
        assert "status=500" in r.extra_info["down/error"] and r.extra_info["reward/missing"] == ["down"]


def test_timeout_is_a_deadline_for_the_whole_request(server):
    """The slow-drip server takes 10 s to finish its answer, never pausing 1 s between bytes: the attempt is still
    cut off by its deadline (timeout_s=1), not held for the whole drip."""
    url, state = server
    scorer = HttpScorer(f"{url}/drip/t", timeout_s=1.0, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(RewardHTTPError, match=r"after 1 attempt\(s\): status=None: timeout after 1.0s"):
        _run(scorer, _samples(1))
    assert time.monotonic() - t0 < 5.0  # bounded by the deadline, far below the 10 s drip
    assert state["hits"]["t"] == 1


def test_scores_must_be_finite_numbers(server):
    url, _ = server
    manager = RewardManager({"h": {"fn": "http", "kwargs": {"url": f"{url}/notnumbers/n"}, "max_retries": 0}})

    async def go():
        try:
            return await manager.score(_samples(5))
        finally:
            await manager.aclose()

    results = asyncio.run(go())
    assert [r.status for r in results] == ["failed"] * 4 + ["ok"]
    assert [r.score for r in results] == [None] * 4 + [0.25]  # never 1.0 / 0.0 for true / false
    for r, kind in zip(results, ("bool", "bool", "str", "bool")):
        assert f"returned a {kind}, expected a number" in r.error


def _png_b64(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_png_decode_refuses_too_many_pixels_by_name_before_decoding():
    """A PNG declares its size in its header: two 6000x6000 pictures (a few kB each) are refused from their headers,
    naming the image and the limit, before anything is decoded; so are images over the request's limit together."""
    from PIL import Image

    from omniroll.reward.http import MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS

    assert MAX_IMAGE_PIXELS < Image.MAX_IMAGE_PIXELS and MAX_IMAGE_PIXELS < MAX_REQUEST_PIXELS
    huge = _png_b64(Image.new("1", (6000, 6000)))  # 1 bit per pixel, compressed to a few kB
    assert len(huge) < 100_000
    with pytest.raises(ValueError, match=r"images\[0\] is 6000x6000 = 36000000 pixels, more than "
                                         r"max_image_pixels=16777216"):
        decode_png_batch({"images": [huge, huge]})
    small = _png_b64(Image.new("RGB", (8, 8), (10, 20, 30)))
    with pytest.raises(ValueError, match=r"images\[0..2\] have 192 pixels together, more than "
                                         r"max_request_pixels=150"):
        decode_png_batch({"images": [small] * 3}, max_request_pixels=150)
    images, _, _ = decode_png_batch({"images": [small] * 2}, max_request_pixels=150)
    assert [im.shape for im in images] == [(3, 8, 8)] * 2 and images[0][:, 0, 0].tolist() == [10, 20, 30]


def test_a_hanging_server_fails_the_batch_at_its_deadline(server):
    """Attempts and backoffs together end at deadline_s, whatever max_retries allows; the manager does not retry an
    http function on top (its max_retries defaults to 0 for http, 2 for the rest), so the row fails at that time."""
    from omniroll.reward.manager import RewardFunctionConfig

    url, state = server
    scorer = HttpScorer(f"{url}/hang/u", timeout_s=0.4, max_retries=50, backoff_s=0.05, deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RewardHTTPError, match=r"status=None: timeout after .*deadline_s=1 reached") as info:
        _run(scorer, _samples(1))
    assert 0.9 < time.monotonic() - t0 < 3.0 and 2 <= info.value.attempts <= 3
    assert RewardFunctionConfig(fn="http", kwargs={"url": url}).max_retries == 0
    assert RewardFunctionConfig(fn="jpeg_compressibility").max_retries == 2
    assert (HttpScorer(url).timeout_s, HttpScorer(url).max_retries, HttpScorer(url).deadline_s) == (30.0, 2, 60.0)
    manager = RewardManager({"h": {"fn": "http", "kwargs": {"url": f"{url}/hang/v", "timeout_s": 0.3,
                                                             "deadline_s": 0.5}}})

    async def go():
        try:
            return await manager.score(_samples(1))
        finally:
            await manager.aclose()

    t0 = time.monotonic()
    (result,) = asyncio.run(go())
    assert result.status == "failed" and "deadline_s=0.5 reached" in result.error
    assert result.extra_info["h/attempts"] == 1 and time.monotonic() - t0 < 2.5


def test_every_reward_call_has_a_total_deadline_named_in_the_row_error(server):
    """With the manager's defaults every function has a total deadline (120 s); at 0.6 s here, a server hanging on one
    batch fails that batch's rows at the deadline, the error naming it and its key, while a batch scored at the same
    time by the same function comes back whole, long before it."""
    from omniroll.reward.manager import DEFAULT_DEADLINE_S, RewardFunctionConfig

    url, state = server
    assert RewardFunctionConfig(fn="http", kwargs={"url": url}).deadline_s == DEFAULT_DEADLINE_S == 120.0
    manager = RewardManager({"h": {"fn": "http", "kwargs": {"url": f"{url}/hangon/w"}, "deadline_s": 0.6}})
    hung = [RewardSample(f"hung{i}", np.full((3, 8, 8), 0, np.uint8), "hang") for i in range(2)]
    done: dict[str, float] = {}

    async def timed(key, samples):
        results = await manager.score(samples)
        done[key] = time.monotonic() - t0
        return results

    async def go():
        try:
            return await asyncio.gather(timed("hung", hung), timed("fine", _samples(3)))
        finally:
            await manager.aclose()

    t0 = time.monotonic()
    hung_results, fine_results = asyncio.run(go())
    for r in hung_results:
        assert r.status == "failed" and r.score is None and r.extra_info["h/attempts"] == 1
        assert "no answer within the total deadline of 0.6 s (reward.functions.h.deadline_s" in r.error, r.error
    assert 0.5 < done["hung"] < 3.0 and [r.status for r in fine_results] == ["ok"] * 3  # at the deadline, not 5 s
    assert [r.score for r in fine_results] == pytest.approx([0.0, 10 / 255, 20 / 255])
    assert done["fine"] < done["hung"] and state["hits"]["w"] == 2
