"""`DeferredInterrupt`: Ctrl-C (SIGINT) held back while a step's critical section runs (its update and weight sync
are never cut in half) and raised as KeyboardInterrupt when the section ends."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class DeferredInterrupt:
    """`handler` is the SIGINT handler (`installed()` sets it for a block); `critical()` the section during which a
    Ctrl-C waits."""

    def __init__(self):
        self.in_critical = False
        self.pending = False

    def handler(self, signum, frame) -> None:
        if self.in_critical:
            self.pending = True  # raised once this step's update and sync are complete
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """`handler` as the SIGINT handler for the block, the one before restored after it (outside the main thread,
        where handlers cannot be set, the default one stays)."""
        old = signal.getsignal(signal.SIGINT)
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, self.handler)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, old)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.in_critical = True
        try:
            yield
        finally:
            self.in_critical = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
