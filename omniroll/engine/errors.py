"""The engine's errors: each names the state or the operation that refused the call."""

from __future__ import annotations


class EngineError(RuntimeError):
    """A request or a call the engine could not serve."""


class EngineAsleepError(EngineError):
    """The engine sleeps, or its denoiser's weights were dropped by sleep(level=2) and no full update landed yet."""


class EngineShutdownError(EngineError):
    """The engine was shut down (or its loop died): every call raises at once."""
