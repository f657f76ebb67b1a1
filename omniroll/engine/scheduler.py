"""Which rows run in the next denoising step: continuous, step-level batching, fair across batch keys (`Scheduler`),
with shared prefixes, which let the members of a group or a tree run no forward before their fork (`PrefixTree`,
`omniroll.engine.prefix_tree`).

Shared prefixes: samples that share their initial noise (`latent_seed`, flow_grpo's `same_latent`) run their common
ODE prefix once, and the branches of a tree rollout (`noise_seeds`) their common noise path up to each fork; every
output stays bitwise identical to running the sample alone (tested); the trainer needs nothing new. A member's steps
before its fork are its leader's, and so are their weight versions (`step_versions`). A tree's requests queued
together are admitted together (`tree_key`), so its leaves share the weight version at admission.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Optional, Union

from omniroll.engine.prefix_tree import PrefixTree
from omniroll.engine.request import RequestState


class Scheduler:
    """Admission and the rows of each step.

    Only rows of one batch key (latent shape and text length) can share a forward. Admission is FCFS per key: a
    waiting request is admitted when its key's running rows plus its own fit in the key's row budget (a CFG request is
    two rows); a request whose key is full never blocks a request of another key, and within a key nobody overtakes.
    The budget is `max_batch_size`: an int, or a function of a request giving its key's rows (asked once per key; the
    engine's measured calibration, `omniroll.engine.calibrate`).

    Each step runs every runnable request of one key, whatever their step index, step count, noise level, SDE type,
    window or guidance. The key is the one served least recently (round robin over the active keys), so a running
    request sits out at most one step per other active key before it runs again (counted in `num_preempted`).

    With prefix sharing, followers of a group's leader (`PrefixTree`) are running but run no forward until their
    fork; they keep their rows reserved, so a group never exceeds `max_batch_size` once it forks. The waiting
    requests of one tree (`tree_key`) are admitted together or not at all.
    """

    def __init__(self, max_batch_size: Union[int, Callable[[RequestState], int]], prefix_sharing: bool = True):
        self._rows_of = max_batch_size if callable(max_batch_size) else (lambda state: max_batch_size)
        self.key_rows: dict[tuple, int] = {}  # batch key -> its row budget
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.prefix = PrefixTree() if prefix_sharing else None
        self._served_at: dict[tuple, int] = {}  # batch key -> the step it last ran
        self._step = 0

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[RequestState]:
        """Move waiting requests into the running set while their key has room; return the newly admitted ones."""
        if not self.waiting:
            return []
        rows = Counter()
        for s in self.running:
            rows[s.batch_key] += s.num_rows
        trees: dict[tuple, list[RequestState]] = {}  # a tree's waiting requests: admitted together
        for state in self.waiting:
            if tree_key(state) is not None:
                trees.setdefault(tree_key(state), []).append(state)
        admitted, kept, full, decided = [], deque(), set(), {}
        for state in self.waiting:
            key, tree = state.batch_key, tree_key(state)
            if tree in decided:
                (admitted if decided[tree] else kept).append(state)
                continue
            budget = self.max_batch_size_for(state)
            need = state.num_rows
            if tree is not None and sum(s.num_rows for s in trees[tree]) <= budget:
                need = sum(s.num_rows for s in trees[tree])  # a tree larger than the budget goes in request by request
            else:
                tree = None
            fits = key not in full and rows[key] + need <= budget
            if fits:
                rows[key] += need
                admitted.append(state)
            else:
                full.add(key)  # FCFS within a key: nothing of this key overtakes the request that did not fit
                kept.append(state)
            if tree is not None:
                decided[tree] = fits
        self.waiting = kept
        self.running.extend(admitted)
        return admitted

    def max_batch_size_for(self, state: RequestState) -> int:
        """The forward-row budget of this request's batch key (never below the request's own rows)."""
        key = state.batch_key
        if key not in self.key_rows:
            self.key_rows[key] = max(int(self._rows_of(state)), 2)
        return self.key_rows[key]

    def schedule(self) -> list[RequestState]:
        """The rows for the next forward: every runnable request of the least recently served key."""
        if self.prefix is not None:
            self.prefix.update(self.running)
            runnable = [s for s in self.running if not self.prefix.is_following(s)]
        else:
            runnable = self.running
        if not runnable:
            return []
        keys = list(dict.fromkeys(s.batch_key for s in runnable))  # in order of their oldest request
        key = min(keys, key=lambda k: self._served_at.get(k, -1))  # ties: the oldest key
        self._step += 1
        self._served_at[key] = self._step
        batch = []
        for s in runnable:
            if s.batch_key == key:
                batch.append(s)
            else:
                s.num_preempted += 1
        return batch

    def fail(self, states: list[RequestState]) -> list[tuple[RequestState, RequestState]]:
        """These running requests failed: take them out, and with them every request waiting for a prefix one of
        them was computing (`PrefixTree.fail`). Returns (dependent, the failed request) for those dependents."""
        ids = {id(s) for s in states}
        self.running = [s for s in self.running if id(s) not in ids]
        doomed = self.prefix.fail(states, self.running) if self.prefix is not None else {}
        dependents = [s for s in self.running if id(s) in doomed]
        self.finish(dependents)
        self._left([])
        return [(s, doomed[id(s)]) for s in dependents]

    def finish(self, states: list[RequestState]) -> None:
        ids = {id(s) for s in states}
        left = [s for s in self.running if id(s) in ids]
        self.running = [s for s in self.running if id(s) not in ids]
        self._left(left)

    def remove(self, request_id: str) -> RequestState | None:
        for s in list(self.running):
            if s.request_id == request_id:
                self.running.remove(s)
                self._left([s])
                return s
        for s in list(self.waiting):
            if s.request_id == request_id:
                self.waiting.remove(s)
                return s
        return None

    def drain_all(self) -> list[RequestState]:
        states = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        if self.prefix is not None:
            self.prefix.clear()
        return states

    def _left(self, states: list[RequestState]) -> None:
        if self.prefix is not None:
            self.prefix.leave(states)
        active = {s.batch_key for s in self.running}
        for key in [k for k in self._served_at if k not in active]:
            del self._served_at[key]  # a key that comes back later starts as the least recently served


def tree_key(state: RequestState) -> Optional[tuple]:
    """The tree a request is a leaf of (None: none): leaves share `latent_seed`, `seed`, prompt and the first
    `noise_seeds` step; admitted together so that they run on one weight version."""
    p = state.params
    if p.latent_seed is None or not p.noise_seeds:
        return None
    return (p.latent_seed, state.request.seed, repr(state.request.prompt_input()), p.noise_seeds[0][0])
