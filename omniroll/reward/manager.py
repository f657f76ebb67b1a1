"""`RewardManager`: run several reward functions concurrently on a batch and combine them per row.

Config (validated with pydantic; unknown keys and out-of-range values raise naming the field)::

    {"functions": {                                   # or just the inner mapping, or a list of {"name": ..., ...}
        "jpeg": {"fn": "jpeg_compressibility", "weight": 0.5},
        "pick": {"fn": "http", "kwargs": {"url": "http://..."}, "required": False},
        "mine": {"fn": "my_pkg.rewards:score", "max_retries": 2, "per_sample": True}},
     "max_batch_size": 16, "max_wait_ms": 5,        # micro-batching knobs used by RewardLoopWorker
     "aggregation": "sum"}                          # or "gdpo" (omniroll/reward/aggregation.py)

Combination (flow_grpo's `multi_score` convention): `score = sum(weight * component)`, weights are not normalized.
With `aggregation: gdpo` the trainer normalises each component within its prompt group before the weighted sum
(`omniroll.reward.aggregation`), so every row needs every component: a non-required function that fails a row fails
that row (naming the function) instead of flagging it; `score` is still the plain weighted sum (what is logged).
Failure policy, per row (never a silent 0):

- a function that raises, times out, returns the wrong number of values, or a value that is not a finite number
  (NaN, Inf, `True` / `False`, a string, or an exception instance: that row's own error) is
  retried (only on the rows that failed) up to `max_retries` times;
- one call of a function on a batch (every attempt and backoff sleep together) ends at its `deadline_s` (default
  `DEFAULT_DEADLINE_S`, 120 s): rows still unscored then carry an error naming the deadline and its key, so a reward
  server or function that hangs holds its rows two minutes at most, never for good;
- still failing and `required` -> the row is `status="failed"`, `score=None`, `error` names the function;
- still failing and not required -> the row is `status="flagged"`, that component is `None`, its error is in
  `extra_info["{name}/error"]`, `extra_info["reward/missing"]` lists such names, and `score` is the weighted sum of the
  components that succeeded (the missing weight is *not* redistributed);
- if no function succeeded at all for a row, it is `failed` whatever `required` says.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
import time
from typing import Any, Callable, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omniroll.reward.aggregation import AGGREGATIONS
from omniroll.reward.scorers import RewardResult, RewardSample, build_scorer, is_async_callable, scorer_problems

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
#: A reward function's total time on one batch, attempts and backoffs together: a reward model scores a micro-batch
#: in seconds, and the `http` scorer gives up on its own after its `deadline_s` (60 s) by default.
DEFAULT_DEADLINE_S = 120.0


class RewardFunctionConfig(BaseModel):
    """One reward function. `timeout_s` bounds each attempt, `deadline_s` all attempts and backoffs of one call
    together (a sync function's thread cannot be interrupted: its rows fail at the deadline, the thread runs on)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    fn: Union[str, Callable] = Field(..., description="registry name, 'module:function', or a callable")
    weight: float = Field(1.0, ge=-1e6, le=1e6, allow_inf_nan=False, description="its weight in the summed reward")
    required: bool = Field(True, description="a row it cannot score fails (True) or is flagged with this "
                                             "component missing (False)")
    max_retries: Optional[int] = Field(None, ge=0, le=10, description="retries of the rows that failed (None: 2, or "
                                       "0 for `http` and `openai_judge`, which retry within their deadline_s)")
    retry_backoff_s: float = Field(0.0, ge=0.0, le=60.0, description="sleep between retries (doubles each time)")
    timeout_s: Optional[float] = Field(None, gt=0.0, le=3600.0, description="deadline of each attempt (None: only "
                                       "deadline_s)")
    deadline_s: float = Field(DEFAULT_DEADLINE_S, gt=0.0, le=86400.0, description="total deadline of one call on a "
                              "batch, every attempt and backoff together: rows not scored by then fail naming it")
    per_sample: bool = Field(False, description="fn takes one RewardSample, not a list")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the scorer's own arguments (model_dir, url, "
                                    "device, ...)")

    @field_validator("fn")
    @classmethod
    def _check_fn(cls, v):
        if isinstance(v, str) and not v.strip():
            raise ValueError("fn must be a non-empty string or a callable")
        return v

    @model_validator(mode="after")
    def _default_retries(self):
        if self.max_retries is None:  # the http scorers retry themselves; retrying again would multiply the deadline
            self.max_retries = 0 if self.fn in ("http", "openai_judge") else 2
        return self

    @model_validator(mode="after")
    def _check_http_deadline(self):
        """An `http` function's own deadline (kwargs.deadline_s) fits in the manager's, or its retries never run."""
        inner = self.kwargs.get("deadline_s") if self.fn == "http" else None
        if isinstance(inner, (int, float)) and inner > self.deadline_s:
            raise ValueError(f"kwargs.deadline_s={inner:g} (the http scorer's own deadline) is past deadline_s="
                             f"{self.deadline_s:g} (the function's total deadline): raise deadline_s to at least "
                             f"{inner:g}")
        return self

    @model_validator(mode="after")
    def _check_resolves(self):
        """`fn` resolves and `kwargs` fit it (module imported, model paths exist), before anything is built."""
        problems = scorer_problems(self.fn, self.kwargs)
        if self.per_sample and isinstance(self.fn, str) and ":" not in self.fn:
            problems.append(f"per_sample: applies to user functions only, not to the builtin scorer {self.fn!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    functions: dict[str, RewardFunctionConfig] = Field(..., min_length=1)
    max_batch_size: int = Field(16, ge=1, le=4096, description="RewardLoopWorker micro-batch size")
    max_wait_ms: float = Field(5.0, ge=0.0, le=10_000.0, description="RewardLoopWorker micro-batch wait")
    aggregation: Literal[AGGREGATIONS] = Field(  # type: ignore[valid-type]
        "sum", description="sum: the weighted sum of the functions' scores, which the algorithm's advantages "
        "normalise per prompt group (trainer.global_std); gdpo: each function's score normalised within its prompt "
        "group (population std + 1e-4), their weighted sum whitened over the batch, and that is the advantage "
        "(clipped at trainer.adv_clip_max; not group-normalised again, trainer.global_std not read); every row "
        "needs every component (omniroll/reward/aggregation.py)")

    @field_validator("functions")
    @classmethod
    def _check_names(cls, v):
        for name in v:
            if not _NAME_RE.match(name):
                raise ValueError(f"function name {name!r} must match {_NAME_RE.pattern} (used in extra_info keys)")
        return v

    @classmethod
    def from_any(cls, config: Any) -> "RewardConfig":
        """Accept a `RewardConfig`, a full config dict, a `{name: fn_config}` mapping, or a list of fn configs
        each carrying a `"name"`."""
        if isinstance(config, RewardConfig):
            return config
        if isinstance(config, (list, tuple)):
            functions = {}
            for i, item in enumerate(config):
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise ValueError(f"reward config list item {i} must be a dict with a str 'name'")
                item = dict(item)
                name = item.pop("name")
                if name in functions:
                    raise ValueError(f"reward config list item {i}: duplicate function name {name!r}")
                functions[name] = item
            return cls.model_validate({"functions": functions})
        if isinstance(config, dict):
            if "functions" in config and set(config) <= set(cls.model_fields):
                return cls.model_validate(config)
            return cls.model_validate({"functions": config})
        raise TypeError(f"reward config must be a RewardConfig, dict or list, got {type(config).__name__}")


class _Outcome:
    """Per function, per row: value or error, plus attempts and time."""

    def __init__(self, n: int):
        self.values: list[Optional[float]] = [None] * n
        self.extras: list[dict] = [{} for _ in range(n)]
        self.errors: list[Optional[str]] = ["not run"] * n
        self.attempts = 0
        self.elapsed_s = 0.0


def _coerce(value: Any) -> tuple[Optional[float], dict, Optional[str]]:
    """One scorer output -> (score, extras, error). An exception instance is that row's error (a scorer that cannot
    score one row of a batch returns it in the row's place, and the other rows keep their scores)."""
    extras = {}
    if isinstance(value, BaseException):
        return None, extras, f"{type(value).__name__}: {value}"
    if isinstance(value, dict):
        if "score" not in value:
            return None, {}, f"returned a dict without 'score' (keys {sorted(value)[:8]})"
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    elif isinstance(value, np.generic) or (hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1):
        value = value.item()  # numpy / torch scalars
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # true / false are not scores
        return None, extras, f"returned a {type(value).__name__}, expected a number"
    f = float(value)
    if not math.isfinite(f):
        return None, extras, f"returned a non-finite score ({f})"
    return f, extras, None


class RewardManager:
    """Scores batches with every configured function concurrently; see the module docstring for the policy."""

    def __init__(self, config: Union[RewardConfig, dict, list]):
        self.config = RewardConfig.from_any(config)
        self.fns: dict[str, Callable] = {}
        for name, fc in self.config.functions.items():
            try:
                self.fns[name] = build_scorer(fc.fn, fc.kwargs, per_sample=fc.per_sample)
            except (ValueError, TypeError) as e:
                raise (TypeError if isinstance(e, TypeError) else ValueError)(f"reward function {name!r}: {e}") from e
        self.weights = {name: fc.weight for name, fc in self.config.functions.items()}

    @property
    def names(self) -> list[str]:
        return list(self.fns)

    async def aclose(self) -> None:
        for fn in self.fns.values():
            close = getattr(fn, "aclose", None)
            if close is not None and inspect.iscoroutinefunction(close):
                await close()

    @staticmethod
    async def _answer(fn: Callable, samples: list[RewardSample]) -> Any:
        out = await (fn(samples) if is_async_callable(fn) else asyncio.to_thread(fn, samples))
        return await out if inspect.isawaitable(out) else out

    async def _call(self, fn: Callable, samples: list[RewardSample], limit: float) -> list:
        """One attempt of `fn` on `samples`, its answer checked for length; `asyncio.TimeoutError` after `limit` s."""
        out = await asyncio.wait_for(self._answer(fn, samples), limit)
        if hasattr(out, "tolist") and not isinstance(out, list):
            out = out.tolist()
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            raise TypeError(f"returned a {type(out).__name__}, expected a list with one value per sample")
        out = list(out)
        if len(out) != len(samples):
            raise ValueError(f"returned {len(out)} values for {len(samples)} samples")
        return out

    async def _run_fn(self, name: str, samples: list[RewardSample]) -> _Outcome:
        fc, fn = self.config.functions[name], self.fns[name]
        res = _Outcome(len(samples))
        pending = list(range(len(samples)))
        t0 = time.perf_counter()
        deadline = t0 + fc.deadline_s
        past = (f"the total deadline of {fc.deadline_s:g} s (reward.functions.{name}.deadline_s, every attempt and "
                "backoff together)")
        for attempt in range(fc.max_retries + 1):
            backoff = fc.retry_backoff_s * 2 ** (attempt - 1) if attempt else 0.0
            if attempt and time.perf_counter() + backoff >= deadline:
                for i in pending:
                    res.errors[i] += f" (no time for a retry within {past})"
                break
            if backoff:
                await asyncio.sleep(backoff)
            res.attempts += 1
            remaining = deadline - time.perf_counter()
            limit = remaining if fc.timeout_s is None else min(fc.timeout_s, remaining)
            try:
                out = await self._call(fn, [samples[i] for i in pending], limit)
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                if limit == remaining:
                    for i in pending:
                        res.errors[i] = f"no answer within {past}; {res.attempts} attempt(s)"
                    break
                for i in pending:
                    res.errors[i] = f"timed out after {fc.timeout_s}s (attempt {attempt + 1})"
                continue
            except Exception as e:  # a scorer's failure is data: recorded, retried, reported
                msg = f"{type(e).__name__}: {e}"
                for i in pending:
                    res.errors[i] = msg
                continue
            still = []
            for i, value in zip(pending, out):
                score, extras, err = _coerce(value)
                res.extras[i] = extras
                if err is None:
                    res.values[i], res.errors[i] = score, None
                else:
                    res.errors[i] = err
                    still.append(i)
            pending = still
            if not pending:
                break
        res.elapsed_s = time.perf_counter() - t0
        return res

    async def score(self, samples: list[RewardSample]) -> list[RewardResult]:
        """Score a batch; one `RewardResult` per sample, in order. Scorer failures never raise (see policy)."""
        samples = list(samples)
        for i, s in enumerate(samples):
            if not isinstance(s, RewardSample):
                raise TypeError(f"samples[{i}] must be a RewardSample, got {type(s).__name__}")
        if not samples:
            return []
        started = time.time()
        names = self.names
        outcomes = dict(zip(names, await asyncio.gather(*(self._run_fn(n, samples) for n in names))))
        finished = time.time()
        return [self._combine(i, s, outcomes, started, finished) for i, s in enumerate(samples)]

    def _combine(self, i: int, sample: RewardSample, outcomes: dict[str, _Outcome], started: float,
                 finished: float) -> RewardResult:
        components: dict[str, Optional[float]] = {}
        extra: dict[str, Any] = {}
        missing, fatal = [], []
        total = 0.0
        for name, oc in outcomes.items():
            value, err = oc.values[i], oc.errors[i]
            components[name] = value
            extra[f"{name}/attempts"] = oc.attempts
            extra[f"{name}/time_s"] = oc.elapsed_s
            for k, v in oc.extras[i].items():
                extra[f"{name}/{k}"] = v
            if err is not None:
                extra[f"{name}/error"] = err
                needed = self.config.functions[name].required or self.config.aggregation == "gdpo"
                (fatal if needed else missing).append(name)
            else:
                total += self.weights[name] * value
        ok_names = [n for n in outcomes if components[n] is not None]
        if ok_names and not math.isfinite(total):
            fatal.append("reward")
            extra["reward/error"] = f"weighted sum of components is not finite ({total})"
        if missing:
            extra["reward/missing"] = missing
        if fatal or not ok_names:
            why = fatal or missing
            error = "; ".join(f"{n}: {extra[f'{n}/error']}" for n in why)
            if not fatal:
                error = "every reward function failed: " + error
            elif self.config.aggregation == "gdpo" and not all(self.config.functions[n].required for n in fatal
                                                                 if n in self.config.functions):
                error = "reward function failed (reward.aggregation gdpo needs every component): " + error
            else:
                error = "required reward function failed: " + error
            return RewardResult(sample.sample_id, None, components, extra, "failed", error, started, finished)
        status = "flagged" if missing else "ok"
        return RewardResult(sample.sample_id, total, components, extra, status, None, started, finished)
