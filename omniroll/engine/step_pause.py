"""`StepPause`: a pause of generation after a chosen number of denoising steps, a component the engine owns
(`engine.step_pause`; it holds no reference to the engine).

`DiffusionEngine.pause_generation(after_steps=k)` arms it; the engine runs `k` more denoising steps
(forwards; 0: none) and then runs no step until `resume_generation()` (or until the pause's own `timeout_s` has passed
since it began, so nothing hangs when the caller never resumes). While paused, running samples keep their latents,
generators and recorded steps, queued requests wait, and control calls still run between steps: a weight update with
`partial=True` lands there, so the samples in flight continue with the new weights after exactly `k` steps. This
makes "the update lands after step k" a deterministic schedule (tests, and a trainer that wants one) instead of a
race with the step loop. The engine thread alone reads and changes it (arming and resuming run as control calls
between two steps); callers wait for a pause to begin through `began`, a threading.Event.
"""

from __future__ import annotations

import threading
import time
from typing import Optional


class StepPause:
    """Armed (`arm`), counted (`count_step`) and read (`paused`) by the engine thread only; `began` is set when the
    pause begins."""

    def __init__(self):
        self.steps_left: Optional[int] = None  # None: not armed; 0: paused (since `since`)
        self.timeout_s = 0.0
        self.since: Optional[float] = None
        self.began = threading.Event()

    def arm(self, after_steps: int, timeout_s: float) -> None:
        self.steps_left, self.timeout_s, self.since = after_steps, timeout_s, None
        self.began.clear()
        self._begin_if_due()

    def resume(self) -> bool:
        """End the pause (or disarm one not begun yet); returns whether one was paused."""
        was = self.since is not None
        self.steps_left, self.since = None, None
        self.began.clear()
        return was

    def count_step(self) -> None:
        """One denoising step ran."""
        if self.steps_left:
            self.steps_left -= 1
            self._begin_if_due()

    @property
    def paused(self) -> bool:
        """Whether no step may run now; a pause past its timeout ends here."""
        if self.since is None:
            return False
        if time.monotonic() - self.since >= self.timeout_s:
            self.resume()
            return False
        return True

    def seconds_left(self) -> Optional[float]:
        """How long the engine loop may sleep before the pause times out (None: no pause, sleep until woken)."""
        if self.since is None:
            return None
        return max(self.timeout_s - (time.monotonic() - self.since), 0.0)

    def state(self) -> dict:
        return {"paused": self.since is not None, "armed_steps_left": self.steps_left if self.since is None else None}

    def _begin_if_due(self) -> None:
        if self.steps_left == 0 and self.since is None:
            self.since = time.monotonic()
            self.began.set()
