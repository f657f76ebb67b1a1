"""Which rows run in the next denoising step (continuous, step-level batching)."""

from __future__ import annotations

from collections import deque

from omniroll.engine.request import RequestState


class Scheduler:
    """FCFS admission into a running set bounded by `max_rows` forward rows (a CFG request is two rows).

    Each step runs every running request whose batch key (latent shape and text length) matches the oldest running
    request's, whatever their step index, step count, noise level, SDE type, window or guidance. Requests of another
    key sit that step out (counted in `num_preempted`) and run when theirs is the oldest key.
    """

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def running_rows(self) -> int:
        return sum(s.num_rows for s in self.running)

    def admit(self) -> list[RequestState]:
        """Move waiting requests into the running set while they fit; return the newly admitted ones."""
        admitted = []
        rows = self.running_rows
        while self.waiting and rows + self.waiting[0].num_rows <= self.max_rows:
            state = self.waiting.popleft()
            rows += state.num_rows
            self.running.append(state)
            admitted.append(state)
        return admitted

    def schedule(self) -> list[RequestState]:
        """The rows for the next forward (all of one batch key)."""
        if not self.running:
            return []
        key = self.running[0].batch_key
        batch = [s for s in self.running if s.batch_key == key]
        for s in self.running:
            if s.batch_key != key:
                s.num_preempted += 1
        return batch

    def finish(self, states: list[RequestState]) -> None:
        ids = {id(s) for s in states}
        self.running = [s for s in self.running if id(s) not in ids]

    def remove(self, request_id: str) -> RequestState | None:
        for queue in (self.running, self.waiting):
            for s in list(queue):
                if s.request_id == request_id:
                    queue.remove(s)
                    return s
        return None

    def drain_all(self) -> list[RequestState]:
        states = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        return states
