"""What an HTTP server generates with: an in-process `DiffusionEngine` or a `RolloutClient` over Ray replicas.

`HttpBackend` gives both the same face: `await generate(request)` returns a completed `DiffusionOutput` or raises
(a sample aborted by a weight update is re-run with the same seed, so its output is the one it would have had);
`reserve(n)` admits n samples or refuses with 503 when the server already holds `max_pending`; `state()` says
whether it can serve now.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Optional

from omniroll.engine.output import DiffusionOutput
from omniroll.engine.params import GenerationRequest
from omniroll.http.contract import ApiError


class HttpBackend:
    def __init__(self, target: Any, max_pending: int = 1024, request_timeout_s: float = 600.0,
                 max_abort_retries: int = 8):
        from omniroll.rollout.client import RolloutClient

        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.target = target
        self.is_client = isinstance(target, RolloutClient)
        self.max_pending = int(max_pending)
        self.request_timeout_s = float(request_timeout_s)
        self.max_abort_retries = int(max_abort_retries)
        self.pending = 0

    @property
    def spatial_multiple(self) -> Optional[int]:
        adapter = getattr(self.target, "adapter", None)
        return None if adapter is None else int(adapter.spatial_multiple)

    @contextlib.contextmanager
    def reserve(self, n: int):
        """Hold n sample slots for the duration of a request; 503 (retry later) when the server is full."""
        if n > self.max_pending:
            raise ApiError(400, f"a request may ask for at most {self.max_pending} samples (the server's "
                                f"max_pending), this one asks for {n}", param="n")
        if self.pending + n > self.max_pending:
            raise ApiError(503, f"server overloaded: {self.pending} samples in flight, limit {self.max_pending}; "
                                "retry later", retry_after=1)
        self.pending += n
        try:
            yield
        finally:
            self.pending -= n

    def state(self) -> str:
        """"ok", or why the engine cannot serve now: "shut down", "asleep", or its weights' state."""
        if self.is_client:
            return "ok"
        st = self.target.stats()
        if st.get("shut_down"):
            return "shut down"
        if st.get("asleep_level"):
            return "asleep"
        if st.get("weights_unusable"):
            return f"not serving: {st['weights_unusable']}"
        return "ok"

    def stats(self) -> dict:
        stats = dict(self.target.stats())
        if not self.is_client:
            stats["rows"] = int(getattr(self.target, "rows_run", 0))
        stats["pending_http_samples"] = self.pending
        return stats

    async def generate(self, request: GenerationRequest) -> DiffusionOutput:
        """One completed sample, or an exception (TimeoutError after request_timeout_s: the sample is aborted)."""
        return await asyncio.wait_for(self._generate(request), timeout=self.request_timeout_s)

    async def _generate(self, request: GenerationRequest) -> DiffusionOutput:
        if self.is_client:  # the client re-runs aborted samples itself
            return await self.target.generate(request.request_id, request.prompt, request.sampling_params,
                                              request.seed, request.negative_prompt)
        for _ in range(self.max_abort_retries + 1):
            out = await self.target.generate_async(request)
            if out.stop_reason != "aborted":
                return out
        raise ApiError(503, f"request {request.request_id!r} was aborted {self.max_abort_retries + 1} times "
                            "(weight updates or sleep); retry later", retry_after=1)
