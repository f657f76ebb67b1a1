"""`openai_judge`: a vision-language model as the reward, behind any OpenAI-compatible chat-completions server (vLLM,
SGLang, TGI, llama.cpp's server, a hosted API): each picture goes as a PNG data URL with a question, and the answer's
log-probabilities become the score.

    reward:
      functions:
        judge:
          fn: openai_judge
          kwargs:
            url: http://judge-host:8000/v1        # POSTs {url}/chat/completions
            model: Qwen/Qwen2.5-VL-7B-Instruct     # the name the server serves
            mode: yes_no                           # or grade (1-5)
            question: 'Does this image show "{prompt}"? Answer yes or no.'

Modes (the first generated token's `top_logprobs`, temperature 0):

- `yes_no`: P(yes) / (P(yes) + P(no)), summing the probability of every top token that reads "yes" (or "no") once
  stripped of spaces and punctuation and lower-cased (`Yes`, ` yes`, `YES`); in [0, 1]. A token absent from the top
  list counts 0 of its probability; neither "yes" nor "no" among them is that sample's error, never a score.
- `grade`: the expected grade over the digits 1-5 among the top tokens, each weighted by its probability
  (renormalised over the digits present), in [1, 5]; without logprobs (a server that ignores them) the answer's first
  digit 1-5. No digit is that sample's error.

One request per picture; `concurrency` of them in flight per call. Each request follows `HttpScorer`'s policy (it
sends through `HttpScorer.post`): `timeout_s` per attempt, `deadline_s` for a request's attempts and backoffs
together, `max_retries` on timeouts, connection errors, 408, 429 and 5xx; other 4xx fail at once. A request that fails
for good fails its own sample alone (`RewardHTTPError` naming the url, status and attempts, in that sample's place:
the `RewardManager` reports it as that row's error, naming the function; the other samples keep their scores), never
a 0. The API key is read from the environment variable `api_key_env` names (never written in a config). Each row's
extras: `answer` (the generated text), `attempts`, and `p_yes` (yes_no).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import os
import string
from typing import Any, Optional

import numpy as np
from PIL import Image

from omniroll.reward.http import HttpScorer, RewardHTTPError

MODES = ("yes_no", "grade")
QUESTIONS = {
    "yes_no": 'Does this image show "{prompt}"? Answer yes or no.',
    "grade": 'How well does this image show "{prompt}"? Answer with one digit from 1 (not at all) to 5 (exactly).',
}
GRADES = ("1", "2", "3", "4", "5")


class JudgeAnswerError(ValueError):
    """The server answered, but not something this mode can read a score from (names the sample)."""


def png_data_url(image_chw: np.ndarray) -> str:
    """`data:image/png;base64,...` of a uint8 CHW image."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0))).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _word(token: str) -> str:
    return token.strip().strip(string.punctuation).lower()


def top_logprobs(choice: dict) -> list[tuple[str, float]]:
    """(token, logprob) of the first generated token's top alternatives in one chat-completions choice ([] when the
    server sent no logprobs)."""
    content = ((choice.get("logprobs") or {}).get("content")) or []
    if not content:
        return []
    first = content[0]
    tops = first.get("top_logprobs") or [{"token": first.get("token", ""), "logprob": first.get("logprob")}]
    out = []
    for t in tops:
        lp = t.get("logprob")
        if isinstance(t.get("token"), str) and isinstance(lp, (int, float)) and math.isfinite(lp):
            out.append((t["token"], float(lp)))
    return out


def yes_no_score(tops: list[tuple[str, float]]) -> tuple[float, float]:
    """(P(yes) / (P(yes) + P(no)), P(yes)) from the first token's top logprobs; ValueError when neither appears."""
    p_yes = sum(math.exp(lp) for tok, lp in tops if _word(tok) == "yes")
    p_no = sum(math.exp(lp) for tok, lp in tops if _word(tok) == "no")
    if p_yes + p_no <= 0.0:
        raise ValueError(f"neither 'yes' nor 'no' among the first token's top logprobs {[t for t, _ in tops][:10]}")
    return p_yes / (p_yes + p_no), p_yes


def grade_score(tops: list[tuple[str, float]], text: str) -> float:
    """The expected grade 1-5 over the digit tokens of the top logprobs; without them, the text's first digit 1-5;
    ValueError when there is none."""
    probs = {g: 0.0 for g in GRADES}
    for tok, lp in tops:
        if _word(tok) in probs:
            probs[_word(tok)] += math.exp(lp)
    total = sum(probs.values())
    if total > 0.0:
        return sum(int(g) * p for g, p in probs.items()) / total
    for ch in text:
        if ch in GRADES:
            return float(ch)
    raise ValueError(f"no grade 1-5 in the answer {text[:80]!r} nor among its top logprobs "
                     f"{[t for t, _ in tops][:10]}")


class OpenAIJudge:
    """The `openai_judge` scorer (module doc). url: the server's base URL (`http://host:8000/v1`; a URL ending in
    `/chat/completions` is used as is); model: the served model's name; question: a template with `{prompt}`;
    top_logprobs: alternatives asked for (at most 20 on OpenAI's API); extra_body: more request fields for the server
    (e.g. vLLM's `{"chat_template_kwargs": ...}`)."""

    def __init__(self, url: str, model: str, mode: str = "yes_no", question: Optional[str] = None,
                 api_key_env: Optional[str] = None, timeout_s: float = 60.0, deadline_s: float = 120.0,
                 max_retries: int = 2, backoff_s: float = 0.5, max_backoff_s: float = 8.0, concurrency: int = 8,
                 top_logprobs: int = 20, extra_body: Optional[dict] = None):
        if mode not in MODES:
            raise ValueError(f"openai_judge.mode must be one of {MODES}, got {mode!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"openai_judge.model must be the served model's name, got {model!r}")
        self.question = QUESTIONS[mode] if question is None else question
        if not isinstance(self.question, str) or "{prompt}" not in self.question:
            raise ValueError(f"openai_judge.question must be a str holding '{{prompt}}', got {question!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= 1024:
            raise ValueError(f"openai_judge.concurrency must be an int in [1, 1024], got {concurrency!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 1 <= top_logprobs <= 20:
            raise ValueError(f"openai_judge.top_logprobs must be an int in [1, 20], got {top_logprobs!r}")
        headers = {}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"openai_judge.api_key_env: the environment variable {api_key_env!r} is not set")
            headers["authorization"] = f"Bearer {key}"
        endpoint = url if str(url).rstrip("/").endswith("/chat/completions") else str(url).rstrip("/") + \
            "/chat/completions"
        self.http = HttpScorer(endpoint, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                               max_backoff_s=max_backoff_s, batch_size=1, headers=headers, deadline_s=deadline_s)
        self.url, self.model, self.mode = endpoint, model, mode
        self.concurrency, self.top_logprobs = concurrency, top_logprobs
        self.extra_body = dict(extra_body or {})

    @staticmethod
    def check_kwargs(kwargs: dict) -> list[str]:
        """Config-time checks (nothing is sent): the mode and a question holding `{prompt}`."""
        problems = []
        if kwargs.get("mode", "yes_no") not in MODES:
            problems.append(f"kwargs.mode: must be one of {', '.join(MODES)}, got {kwargs.get('mode')!r}")
        q = kwargs.get("question")
        if q is not None and (not isinstance(q, str) or "{prompt}" not in q):
            problems.append(f"kwargs.question: must be a str holding '{{prompt}}', got {q!r}")
        return problems

    def __repr__(self):
        return f"OpenAIJudge(url={self.url!r}, model={self.model!r}, mode={self.mode!r})"

    async def aclose(self) -> None:
        await self.http.aclose()

    def request_body(self, sample) -> bytes:
        """The chat-completions request for one sample: the picture as a PNG data URL, then the question."""
        if sample.image.ndim != 3:
            raise ValueError(f"sample {sample.sample_id!r} is a video {tuple(sample.image.shape)}: openai_judge "
                             f"sends one picture")
        body = {"model": self.model, "temperature": 0.0, "max_tokens": 1,
                "logprobs": True, "top_logprobs": self.top_logprobs,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(sample.image)}},
                    {"type": "text", "text": self.question.replace("{prompt}", sample.prompt)}]}],
                **self.extra_body}
        return json.dumps(body).encode("utf-8")

    def read_answer(self, sample, response, attempts: int) -> dict:
        """One response -> `{"score", "answer", "attempts"[, "p_yes"]}`; JudgeAnswerError naming the sample when no
        score can be read from it."""
        try:
            data = response.json()
            choice = data["choices"][0]
            text = str((choice.get("message") or {}).get("content") or "")
            tops = top_logprobs(choice)
            row: dict[str, Any] = {"answer": text, "attempts": attempts}
            if self.mode == "yes_no":
                row["score"], row["p_yes"] = yes_no_score(tops)
            else:
                row["score"] = grade_score(tops, text)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise JudgeAnswerError(f"sample {sample.sample_id!r}: {self.url} answered, but {type(e).__name__}: {e}")
        return row

    async def _one(self, sample, gate: asyncio.Semaphore) -> dict:
        async with gate:
            body = self.request_body(sample)
            response, attempts = await self.http.post(body, "application/json")
        return self.read_answer(sample, response, attempts)

    async def __call__(self, samples) -> list:
        samples = list(samples)
        gate = asyncio.Semaphore(self.concurrency)
        out = await asyncio.gather(*(self._one(s, gate) for s in samples), return_exceptions=True)
        for i, (s, r) in enumerate(zip(samples, out)):
            if isinstance(r, RewardHTTPError):  # name the sample as well as the url (the manager names the function)
                out[i] = RewardHTTPError(r.url, r.status, r.attempts, f"sample {s.sample_id!r}: {r.detail}")
            elif isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # cancellation and the like are not a sample's failure
        return out
