"""Engines still running at interpreter exit are shut down first: a daemon loop thread killed inside a torch kernel
aborts the process ("terminate called without an active exception", exit status 134)."""

from __future__ import annotations

import atexit
import weakref

_LIVE = weakref.WeakSet()


def register(engine) -> None:
    """`engine`'s loop thread has started."""
    _LIVE.add(engine)


def forget(engine) -> None:
    """`engine` was shut down."""
    _LIVE.discard(engine)


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_LIVE):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway; one engine's error must not keep the others running
            pass
