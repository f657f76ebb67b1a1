"""`openai_judge`, the VLM judge behind an OpenAI-compatible server, end to end against a real server on 127.0.0.1
that speaks OpenAI's chat-completions API (FastAPI + uvicorn): the picture as a PNG data URL, yes / no scored by the
answer's log-probabilities, a 1-5 grade, retries, deadlines, concurrency, and a failed call failing its own sample by
name."""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import math

import numpy as np
import pytest
from http_helpers import serving
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

from omniroll.config import ConfigError, load_config
from omniroll.reward import RewardManager, RewardSample
from omniroll.reward.openai_judge import grade_score, yes_no_score


def _brightness(data_url: str) -> float:
    head, b64 = data_url.split(",", 1)
    assert head == "data:image/png;base64"
    return float(np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).mean()) / 255.0


def _p_yes(m: float) -> float:
    return 0.01 + 0.98 * m


def _make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        content = body["messages"][0]["content"]
        image = next(c for c in content if c["type"] == "image_url")["image_url"]["url"]
        text = next(c for c in content if c["type"] == "text")["text"]
        prompt = text.split('"')[1]
        state["requests"].append({"body": body, "auth": request.headers.get("authorization"), "prompt": prompt})
        state["hits"][prompt] += 1
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            await asyncio.sleep(0.02)
            if prompt.startswith("broken"):
                return JSONResponse({"error": {"message": "the judge crashed"}}, status_code=500)
            if prompt.startswith("flaky") and state["hits"][prompt] == 1:
                return JSONResponse({"error": {"message": "warming up"}}, status_code=503)
            if prompt.startswith("slow"):
                await asyncio.sleep(2.0)
            m = _brightness(image)
            if "yes or no" in text:
                p = _p_yes(m)
                tops = [("Yes", 0.8 * p), (" yes", 0.2 * p), ("No", 1 - p)]
                if prompt.startswith("garbled"):
                    tops = [("Maybe", 0.7), ("Perhaps", 0.3)]
                answer = "Yes" if p >= 0.5 else "No"
            else:  # a grade: 5 with probability m, 1 otherwise
                tops = [("5", m), ("1", 1 - m), ("The", 1e-6)]
                answer = "5" if m >= 0.5 else "1"
            tops = [(t, q) for t, q in tops if q > 0]
            logprobs = {"content": [{"token": tops[0][0], "logprob": math.log(tops[0][1]),
                                     "top_logprobs": [{"token": t, "logprob": math.log(q)} for t, q in tops]}]}
            if prompt.startswith("nologprobs"):
                logprobs, answer = None, "4"
            return {"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                 "logprobs": logprobs, "finish_reason": "length"}]}
        finally:
            state["in_flight"] -= 1

    return app


@pytest.fixture(scope="module")
def judge():
    state = {"hits": collections.Counter(), "requests": [], "in_flight": 0, "max_in_flight": 0}
    with serving(_make_app(state)) as url:
        yield f"{url}/v1", state


def _samples(prompts, values=None):
    values = values or [30 * (i + 1) for i in range(len(prompts))]
    return [RewardSample(f"s{i}-{p.split()[0]}", np.full((3, 8, 8), v, np.uint8), p)
            for i, (p, v) in enumerate(zip(prompts, values))]


def _score(config, samples):
    async def go():
        manager = RewardManager(config)
        try:
            return await manager.score(samples)
        finally:
            await manager.aclose()

    return asyncio.run(go())


def test_yes_no_is_the_probability_of_yes_and_a_failed_call_fails_its_sample_by_name(judge, monkeypatch):
    url, state = judge
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    cfg = {"judge": {"fn": "openai_judge", "kwargs": {"url": url, "model": "tiny-vlm", "api_key_env": "JUDGE_KEY",
                                                      "max_retries": 1, "backoff_s": 0.01, "concurrency": 3}}}
    samples = _samples(["a red car", "broken judge", "a blue bird", "flaky start", "a cat"])
    results = _score(cfg, samples)
    ok = [0, 2, 3, 4]
    for i in ok:
        assert results[i].status == "ok"
        assert results[i].score == pytest.approx(_p_yes(samples[i].image.mean() / 255.0), rel=1e-9)
        assert results[i].extra_info["judge/answer"] in ("Yes", "No")
    assert results[3].extra_info["judge/attempts"] == 2  # retried after its 503
    bad = results[1]
    assert bad.status == "failed" and bad.score is None and bad.components["judge"] is None
    assert "judge: RewardHTTPError" in bad.error and "'s1-broken'" in bad.error and "status=500" in bad.error
    assert url in bad.error and "after 2 attempt(s)" in bad.error
    # what went over the wire: the picture as a PNG data URL, logprobs asked for, the key from the environment
    req = state["requests"][0]
    assert req["auth"] == "Bearer sk-test"
    assert req["body"]["logprobs"] is True and req["body"]["top_logprobs"] == 20 and req["body"]["max_tokens"] == 1
    assert req["body"]["model"] == "tiny-vlm" and req["body"]["temperature"] == 0.0
    assert 1 < state["max_in_flight"] <= 3  # concurrent requests, at most `concurrency`


def test_a_grade_is_the_expected_digit_and_the_text_when_no_logprobs(judge):
    url, _ = judge
    cfg = {"grade": {"fn": "openai_judge", "kwargs": {"url": url + "/chat/completions", "model": "tiny-vlm",
                                                      "mode": "grade"}}}
    samples = _samples(["a red car", "nologprobs here", "garbled but graded"], values=[51, 200, 255])
    results = _score(cfg, samples)
    assert results[0].score == pytest.approx(1 + 4 * 0.2)  # 5 with probability 0.2, else 1
    assert results[1].score == 4.0  # the server sent no logprobs: the answer's digit
    assert results[2].score == pytest.approx(5.0)


def test_an_answer_without_yes_or_no_and_a_deadline_fail_their_sample_never_zero(judge):
    url, _ = judge
    cfg = {"judge": {"fn": "openai_judge", "kwargs": {"url": url, "model": "tiny-vlm", "timeout_s": 0.5,
                                                      "deadline_s": 0.8, "max_retries": 3, "backoff_s": 0.01}}}
    results = _score(cfg, _samples(["garbled answer", "slow judge", "a red car"]))
    assert results[0].status == "failed" and "neither 'yes' nor 'no'" in results[0].error
    assert "'s0-garbled'" in results[0].error
    assert results[1].status == "failed" and "timeout" in results[1].error and "'s1-slow'" in results[1].error
    assert results[2].status == "ok" and 0 < results[2].score < 1


def test_the_pure_conversions():
    assert yes_no_score([("Yes", math.log(0.6)), ("no", math.log(0.2)), ("YES.", math.log(0.1))]) == \
        (pytest.approx(0.7 / 0.9), pytest.approx(0.7))
    assert yes_no_score([("Yes", 0.0)])[0] == 1.0  # no "no" among the alternatives: its probability is below them all
    with pytest.raises(ValueError, match="neither 'yes' nor 'no'"):
        yes_no_score([("Maybe", 0.0)])
    assert grade_score([("2", math.log(0.25)), ("4", math.log(0.25)), ("x", math.log(0.5))], "") == 3.0
    with pytest.raises(ValueError, match="no grade 1-5"):
        grade_score([], "excellent")


def test_judge_config_errors_name_the_field(monkeypatch):
    def cfg(**kwargs):
        return {"reward": {"functions": {"judge": {"fn": "openai_judge", "kwargs": kwargs}}}}

    with pytest.raises(ConfigError, match=r"reward\.functions\.judge.*kwargs\.mode: must be one of yes_no, grade"):
        load_config(cfg(url="http://127.0.0.1:1/v1", model="m", mode="score"))
    with pytest.raises(ConfigError, match=r"reward\.functions\.judge.*missing a required argument: 'model'"):
        load_config(cfg(url="http://127.0.0.1:1/v1"))
    with pytest.raises(ConfigError, match=r"kwargs\.question: must be a str holding '\{prompt\}'"):
        load_config(cfg(url="http://127.0.0.1:1/v1", model="m", question="Is it good?"))
    c = load_config(cfg(url="http://127.0.0.1:1/v1", model="m"))
    assert c.reward.functions["judge"].max_retries == 0  # it retries within its own deadline_s
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="api_key_env: the environment variable 'NO_SUCH_JUDGE_KEY' is not set"):
        RewardManager({"judge": {"fn": "openai_judge", "kwargs": {"url": "http://127.0.0.1:1/v1", "model": "m",
                                                                   "api_key_env": "NO_SUCH_JUDGE_KEY"}}})
