"""Errors a caller can act on. `RequestError` is the request's own fault (never retry it elsewhere); the others name
the engine state or the operation that refused the call."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine will not serve as asked: a bad field, a prompt that cannot be encoded, a duplicate
    request id. Only this request fails; retrying it on another replica gives the same error, so routing clients
    never retry it and never count it against a replica. `request_id` and `reason` are kept when the error is
    pickled (e.g. across Ray)."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id, self.reason = request_id, reason

    def __reduce__(self):
        return (type(self), (self.request_id, self.reason))


class EngineError(RuntimeError):
    """A request or a call the engine could not serve."""


class EngineAsleepError(EngineError):
    """The engine sleeps, or its denoiser's weights were dropped by sleep(level=2) and no full update landed yet."""


class EngineOverloadedError(EngineError):
    """The engine's queue holds `EngineConfig.max_waiting` requests that wait to start: the call was refused whole
    (nothing queued). Another replica, or the same one later, can take it."""


class EngineShutdownError(EngineError):
    """The engine was shut down (or its loop died): every call raises at once."""
