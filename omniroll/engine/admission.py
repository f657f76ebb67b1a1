"""Admission: a request from its arrival to its first step. It becomes a `RequestState` (every check first, in the
caller's thread), and admitted states get their prompt encodings (each prompt in its own guard, on the engine thread)
from the engine's `PromptCache`, a bounded LRU: a prompt is encoded once however many samples of it are running.

Both are the engine's only entry points for a request's content, so every check of a request lives here: the model's
limits (resolution, text length, frames, guidance), prompt size, token ids. A failure is a `RequestError` naming the
request before anything is queued or encoded; a prompt that fails to encode fails its own request only. The queue's
bound (`check_queue`, `EngineConfig.max_waiting`) is checked here too. A state holds no latent until the engine
admits it (`RequestState.start`).

A prompt is text or per-encoder token ids (`{"clip": [...], "t5": [...]}`); each is cached under its own key (the
text, or the ids), with the text length.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from typing import Hashable, Union

from omniroll.engine.config import EngineConfig
from omniroll.engine.errors import EngineError, EngineOverloadedError, RequestError
from omniroll.engine.params import GenerationRequest
from omniroll.engine.request import RequestState
from omniroll.models.base import Conditioning, DiffusionAdapter


def build_state(adapter: DiffusionAdapter, config: EngineConfig, device, request: GenerationRequest,
                on_done) -> RequestState:
    """Check `request` against the model and the engine's limits and build its state (sigmas, latent shape, CFG
    scale, experts). Raises `RequestError` naming the request and the field, TypeError for a non-request."""
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
    p, rid = request.sampling_params, request.request_id
    try:
        adapter.limits.check(p.height, p.width, p.max_sequence_length, prefix="sampling_params.")
        adapter.check_num_frames(p.num_frames)
        adapter.check_guidance(p.guidance_scale, p.true_cfg_scale)
    except ValueError as e:
        raise RequestError(rid, str(e)) from None
    limit = config.max_prompt_chars
    for name, text in (("prompt", request.prompt), ("negative_prompt", request.negative_prompt)):
        if isinstance(text, str) and len(text) > limit:
            raise RequestError(rid, f"{name} has {len(text)} characters, more than max_prompt_chars={limit} "
                                    f"(EngineConfig.max_prompt_chars)")
    for field, ids in (("prompt_token_ids", request.prompt_token_ids),
                       ("negative_prompt_token_ids", request.negative_prompt_token_ids)):
        if ids is not None:
            try:
                adapter.check_token_ids(ids, p.max_sequence_length, field)
            except ValueError as e:
                raise RequestError(rid, str(e)) from None
    latent_shape = adapter.latent_shape(p.height, p.width, p.num_frames)
    sigmas = adapter.sigmas(p.num_inference_steps, p.height, p.width, p.num_frames)
    state = RequestState(request, sigmas, latent_shape, on_done, device=device,
                         cfg_scale=adapter.cfg_scale(p.guidance_scale, p.true_cfg_scale))
    if adapter.num_experts > 1:
        state.experts = [adapter.expert_index(float(t)) for t in state.timesteps]
    return state


def accept(adapter: DiffusionAdapter, config: EngineConfig, device, requests: list[GenerationRequest],
           release) -> tuple[list[concurrent.futures.Future], list[RequestState]]:
    """Accept `requests` (queued next, admitted to steps later by `Scheduler.admit`): every request's state (all
    checked first: an error raises before any is queued) and the future its caller waits on. When a request is
    done its state frees its id (`release(request_id)`), then settles the future exactly once."""
    futures, states = [], []
    for request in requests:
        future: concurrent.futures.Future = concurrent.futures.Future()
        state = build_state(adapter, config, device, request, None)
        state.on_done = _settler(future, state.request_id, release)
        states.append(state)
        futures.append(future)
    return futures, states


def check_queue(waiting: int, adding: int, max_waiting: int) -> None:
    """Refuse a call whose `adding` requests would make more than `max_waiting` wait to start (EngineOverloadedError:
    nothing of the call is queued)."""
    if waiting + adding > max_waiting:
        raise EngineOverloadedError(f"the engine's queue is full: {waiting} request(s) wait to start and {adding} more "
                                    f"would pass max_waiting={max_waiting} (engine.max_waiting); nothing of this call "
                                    f"was queued: retry later or on another replica")


def _settler(future: concurrent.futures.Future, request_id: str, release):
    def on_done(output, error):
        release(request_id)
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(output)

    return on_done


PromptInput = Union[str, dict]


def prompt_key(prompt: PromptInput) -> Hashable:
    """The cache key of a prompt: the text itself, or its token ids per encoder."""
    if isinstance(prompt, str):
        return prompt
    return ("token_ids",) + tuple(sorted((k, tuple(int(i) for i in v)) for k, v in prompt.items()))


class PromptCache:
    def __init__(self, adapter: DiffusionAdapter, capacity: int):
        self.adapter = adapter
        self.capacity = capacity
        self._cache: OrderedDict[tuple[Hashable, int], Conditioning] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get_many(self, prompts: list[PromptInput], max_sequence_length: int) -> list[Conditioning | Exception]:
        """Encodings for `prompts` (texts or token ids; duplicates allowed); only the missing unique ones are
        encoded, each inside its own guard: a prompt that fails to encode gets its exception in its place (never
        cached) and the others are unaffected. The returned tensors are the cache's own: callers must not hand them
        out (see outputs)."""
        keys = [prompt_key(p) for p in prompts]
        found: dict[Hashable, Conditioning | Exception] = {}
        for k in keys:
            if (k, max_sequence_length) in self._cache:
                self._cache.move_to_end((k, max_sequence_length))
                found[k] = self._cache[(k, max_sequence_length)]
        missing = {k: p for k, p in zip(keys, prompts) if k not in found}
        for k, prompt in missing.items():
            try:
                if isinstance(prompt, str):
                    cond = self.adapter.encode_prompts([prompt], max_sequence_length)[0]
                else:
                    cond = self.adapter.encode_token_ids([prompt], max_sequence_length)[0]
            except Exception as e:  # noqa: BLE001 - this prompt's requests fail, nobody else's
                found[k] = e
                continue
            found[k] = cond
            self._put((k, max_sequence_length), cond)
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        return [found[k] for k in keys]

    def _put(self, key, cond: Conditioning) -> None:
        self._cache[key] = cond
        self._cache.move_to_end(key)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)


def attach_encodings(prompt_cache: PromptCache, states: list[RequestState]) -> list[tuple[RequestState, Exception]]:
    """Attach prompt (and, for CFG rows, negative prompt) encodings to `states`. Each prompt is encoded in its own
    guard (`PromptCache.get_many`); returns the states whose prompt failed, each with its error (the others go on)."""
    by_len: dict[int, list[RequestState]] = {}
    for s in states:
        by_len.setdefault(s.params.max_sequence_length, []).append(s)
    failed: dict[int, tuple[RequestState, Exception]] = {}
    for length, group in by_len.items():
        conds = prompt_cache.get_many([s.request.prompt_input() for s in group], length)
        cfg = [s for s in group if s.num_rows == 2]
        negs = prompt_cache.get_many([s.request.negative_input() for s in cfg], length)
        for field, members, encodings in (("prompt", group, conds), ("negative_prompt", cfg, negs)):
            for s, c in zip(members, encodings):
                if isinstance(c, Exception):
                    failed.setdefault(id(s), (s, encode_error(s.request_id, field, c)))
                elif field == "prompt":
                    s.cond = c
                else:
                    s.uncond = c
    return list(failed.values())


def encode_error(request_id: str, field: str, error: Exception) -> Exception:
    """A tokenizer's refusal (ValueError / TypeError / UnicodeError) is the request's fault: `RequestError`, never
    retried. Anything else (out of memory, a broken encoder) is the engine's: `EngineError`."""
    reason = f"{field} could not be encoded: {type(error).__name__}: {error}"
    if isinstance(error, (ValueError, TypeError, UnicodeError)):
        return RequestError(request_id, reason)
    return EngineError(f"request {request_id!r} failed: {reason}")
