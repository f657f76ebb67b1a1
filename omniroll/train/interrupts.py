"""`DeferredInterrupt`: Ctrl-C (SIGINT) held back while a step's critical section runs (its update and weight sync
are never cut in half) and raised as KeyboardInterrupt when the section ends."""

from __future__ import annotations

import contextlib
from typing import Iterator


class DeferredInterrupt:
    """`handler` is the SIGINT handler; `critical()` the section during which a Ctrl-C waits."""

    def __init__(self):
        self.in_critical = False
        self.pending = False

    def handler(self, signum, frame) -> None:
        if self.in_critical:
            self.pending = True  # raised once this step's update and sync are complete
            return
        raise KeyboardInterrupt

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
