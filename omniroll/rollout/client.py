"""`RolloutClient`: routes single-sample requests to rollout replicas, with timeouts and retries.

The role of verl's `LLMServerClient` + `GlobalRequestLoadBalancer`, but in-process: each agent-loop worker owns a
client (the object pickles to its constructor arguments, so each worker gets its own counters). No central actor, no
extra RPCs per sample.

Routing: every sample of one `group_id` (the prompt-group uid) goes to the same replica (a bounded LRU sticky map), so
the engine's prompt-encode cache hits; other requests go to the replica with the fewest in-flight requests from this
client, ties broken round-robin. A sticky replica that is unhealthy, or that has `sticky_slack` more requests in flight
than the least-loaded one, is bypassed.

Faults: a dead replica (RayActorError), a timed-out request, or any unexpected error is aborted there (best effort),
the replica is benched for `unhealthy_s`, and the SAME request (same seed, so the output is identical) is re-run on
another replica, at most `max_retries` times; then `RolloutError` names the request and every attempt. An output with
stop_reason="aborted" (e.g. a weight update on the replica) is re-run too, at most `max_abort_retries` times.
A bad request is told apart from a replica fault: it is refused here (local validation) or by the replica with the
engine's `RequestError` (a bad field, a prompt that cannot be encoded or is too long, a duplicate request id),
which crosses Ray as itself. It is never retried and never benches a replica: `generate` raises `RequestError`
naming the request and the reason. Every other error is a fault of the replica.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Optional

from pydantic import ValidationError

from omniroll.engine.errors import RequestError
from omniroll.engine.output import DiffusionOutput
from omniroll.engine.params import GenerationRequest, SamplingParams
from omniroll.errors import format_validation_error
from omniroll.rollout.wire import output_from_wire


class RolloutError(RuntimeError):
    """A request that failed on every attempt. `attempts` lists (replica index, error) per attempt."""

    def __init__(self, message: str, request_id: str = "", attempts: Optional[list] = None):
        super().__init__(message, request_id, attempts or [])
        self.message, self.request_id, self.attempts = message, request_id, attempts or []

    def __str__(self) -> str:
        return self.message


def build_request(
    request_id: str,
    prompt: str,
    sampling_params: dict | SamplingParams | None,
    seed: int,
    negative_prompt: Optional[str] = None,
) -> GenerationRequest:
    """Validate locally so a bad field fails fast, before any RPC, with the field named."""
    try:
        if sampling_params is None:
            sp = SamplingParams()
        elif isinstance(sampling_params, SamplingParams):
            sp = sampling_params
        else:
            sp = SamplingParams.model_validate(dict(sampling_params))
    except ValidationError as e:
        raise RequestError(request_id, f"bad sampling_params: {_describe(e, 'sampling_params')}") from None
    if not isinstance(prompt, str):
        raise RequestError(request_id, f"prompt must be a string, got {type(prompt).__name__}")
    try:
        return GenerationRequest(
            request_id=request_id, prompt=prompt, negative_prompt=negative_prompt, sampling_params=sp, seed=seed
        )
    except ValidationError as e:
        raise RequestError(request_id, _describe(e)) from None


def _describe(e: ValidationError, prefix: str = "") -> str:
    return format_validation_error(e, prefix, empty_loc=prefix or "<request>")


class RolloutClient:
    def __init__(
        self,
        replica_handles: list,
        timeout_s: float = 600.0,
        max_retries: int = 2,
        max_abort_retries: int = 8,
        unhealthy_s: float = 30.0,
        sticky_size: int = 10_000,
        sticky_slack: int = 64,
    ):
        if not replica_handles:
            raise ValueError("RolloutClient needs at least one replica handle")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._args = dict(
            replica_handles=list(replica_handles), timeout_s=timeout_s, max_retries=max_retries,
            max_abort_retries=max_abort_retries, unhealthy_s=unhealthy_s, sticky_size=sticky_size,
            sticky_slack=sticky_slack,
        )
        self.replicas = list(replica_handles)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_abort_retries = int(max_abort_retries)
        self.unhealthy_s = float(unhealthy_s)
        self.sticky_size = int(sticky_size)
        self.sticky_slack = int(sticky_slack)
        n = len(self.replicas)
        self.in_flight = [0] * n
        self.served = [0] * n
        self._unhealthy_until = [0.0] * n
        self._dead: set[int] = set()
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._rr = 0
        self._running: set[str] = set()  # caller request_ids in flight (a second one with the same id is refused)

    # A client crosses process boundaries as its configuration; counters and sticky map start fresh.
    def __getstate__(self):
        return self._args

    def __setstate__(self, state):
        self.__init__(**state)

    # ------------------------------------------------------------------ routing
    def _healthy(self, idx: int, now: float) -> bool:
        return idx not in self._dead and self._unhealthy_until[idx] <= now

    def _pick(self, group_id: Optional[str], avoid: set[int]) -> int:
        now = time.monotonic()
        alive = [i for i in range(len(self.replicas)) if i not in self._dead]
        if not alive:
            raise RolloutError("every rollout replica is dead", attempts=[])
        cands = [i for i in alive if self._healthy(i, now) and i not in avoid]
        if not cands:  # everything is benched or already failed this request: fall back to any live replica
            cands = [i for i in alive if i not in avoid] or alive
        least = min(self.in_flight[i] for i in cands)
        if group_id is not None:
            s = self._sticky.get(group_id)
            if s is not None and s in cands and self.in_flight[s] - least <= self.sticky_slack:
                self._sticky.move_to_end(group_id)
                return s
        n = len(self.replicas)
        tied = [i for i in cands if self.in_flight[i] == least]
        pick = min(tied, key=lambda i: (i - self._rr) % n)  # round-robin among ties
        self._rr = (pick + 1) % n
        if group_id is not None:
            self._sticky[group_id] = pick
            self._sticky.move_to_end(group_id)
            while len(self._sticky) > self.sticky_size:
                self._sticky.popitem(last=False)
        return pick

    def _bench(self, idx: int, dead: bool) -> None:
        if dead:
            self._dead.add(idx)
        else:
            self._unhealthy_until[idx] = time.monotonic() + self.unhealthy_s
        for g in [g for g, i in self._sticky.items() if i == idx]:
            del self._sticky[g]

    def _abort_on(self, idx: int, engine_request_id: str) -> None:
        try:
            self.replicas[idx].abort.remote(engine_request_id)  # best effort; the result is not awaited
        except Exception:
            pass

    # ------------------------------------------------------------------ API
    async def generate(
        self,
        request_id: str,
        prompt: str,
        sampling_params: dict | SamplingParams | None,
        seed: int,
        negative_prompt: Optional[str] = None,
        group_id: Optional[str] = None,
    ) -> DiffusionOutput:
        """Generate one sample. Returns the DiffusionOutput (tensors, stop_reason "completed"); raises RequestError
        for a malformed request and RolloutError when every attempt failed."""
        import ray

        # 1. Validate the request here (a bad one never reaches a replica) and refuse an id already in flight.
        request = build_request(request_id, prompt, sampling_params, seed, negative_prompt)
        if request_id in self._running:
            raise RequestError(request_id, "request_id is already in flight on this client")
        attempts: list[tuple[int, str]] = []
        failed_on: set[int] = set()
        failures = aborts = 0
        t0 = time.time()
        self._running.add(request_id)
        try:
            while True:
                # 2. Pick a replica (sticky per group, else the least loaded; never one this request failed on).
                idx = self._pick(group_id, failed_on)
                k = len(attempts)
                engine_id = request_id if k == 0 else f"{request_id}~retry{k}"
                payload = request.model_dump() if k == 0 else {**request.model_dump(), "request_id": engine_id}
                # 3. Run it there; a fault (timeout, dead actor, crash) aborts it there and benches the replica.
                self.in_flight[idx] += 1
                err: Optional[str] = None
                try:
                    ref = self.replicas[idx].generate.remote(payload)
                    wire = await asyncio.wait_for(_await_ref(ref), timeout=self.timeout_s)
                except RequestError as e:  # the replica refused the request itself: not retried, not benched
                    reason = getattr(getattr(e, "cause", None) or e, "reason", str(e))
                    raise RequestError(request_id, f"rejected by replica {idx}: {reason}") from None
                except asyncio.TimeoutError:
                    err = f"timed out after {self.timeout_s:g}s"
                    self._abort_on(idx, engine_id)
                    self._bench(idx, dead=False)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    err = f"replica unavailable: {type(e).__name__}: {_last_line(e)}"
                    self._bench(idx, dead=isinstance(e, ray.exceptions.ActorDiedError))
                except asyncio.CancelledError:
                    self._abort_on(idx, engine_id)
                    raise
                except Exception as e:  # engine crash, OOM, ...: try elsewhere
                    err = f"{type(e).__name__}: {_last_line(e)}"
                    self._abort_on(idx, engine_id)
                    self._bench(idx, dead=False)
                finally:
                    self.in_flight[idx] -= 1
                # 4. An aborted output runs again (same seed: the same sample); a completed one is returned.
                if err is None:
                    out = output_from_wire(wire)
                    if out.stop_reason == "aborted":
                        aborts += 1
                        attempts.append((idx, "aborted"))
                        if aborts > self.max_abort_retries:
                            err = f"aborted {aborts} times"
                        else:
                            continue  # same request, same seed: identical output once it completes
                    else:
                        self.served[idx] += 1
                        ef = out.extra_fields
                        ef["request_id"] = request_id
                        ef["rollout_attempts"] = len(attempts) + 1
                        ef["replica_index"] = idx
                        ef["client_seconds"] = time.time() - t0
                        out.num_preempted = int(out.num_preempted or 0) + aborts
                        return out
                else:
                    attempts.append((idx, err))
                    failed_on.add(idx)
                    failures += 1
                # 5. Out of retries: one error naming the request and every attempt.
                if failures > self.max_retries or aborts > self.max_abort_retries:
                    tried = "; ".join(f"#{j} replica {i}: {e}" for j, (i, e) in enumerate(attempts))
                    raise RolloutError(
                        f"request {request_id!r} failed after {len(attempts)} attempt(s): {tried}",
                        request_id=request_id, attempts=attempts,
                    )
        finally:
            self._running.discard(request_id)

    def stats(self) -> dict:
        now = time.monotonic()
        return {
            "in_flight": list(self.in_flight),
            "served": list(self.served),
            "healthy": [self._healthy(i, now) for i in range(len(self.replicas))],
            "dead": sorted(self._dead),
            "sticky_groups": len(self._sticky),
        }


async def _await_ref(ref: Any) -> Any:
    return await ref


def _last_line(e: BaseException) -> str:
    """The last line of the error's text: a Ray task error is a remote traceback that ends with the exception."""
    s = str(e).strip().splitlines()
    return s[-1] if s else repr(e)
