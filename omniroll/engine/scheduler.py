"""Which rows run in the next denoising step: continuous, step-level batching, fair across batch keys (`Scheduler`),
and group prefix sharing, which lets the followers of a group run no forward before their fork (`PrefixSharing`).

Group prefix sharing: samples that share their initial noise run their common ODE prefix once.
Samples with the same `latent_seed` (flow_grpo's `same_latent`), prompt, negative prompt, latent shape, schedule,
guidance, text length and weight version at admission have the same initial latent and the same SDE window start `k`;
every step before `k` is the same deterministic ODE step for all of them (no noise is drawn outside the window). One
member, the leader, runs those steps; the others (followers) run no forward until the leader reaches step `k`, then
each takes a copy of the leader's latent and goes on alone from step `k`, drawing its own window noise. The steps are
the same computation on the same inputs, so in batch-invariant mode every output is bitwise identical to running the
sample alone (tested); the trainer needs nothing new. A fork copies the leader's solver history (`solver_state`) with
its latent: a multistep solver's next step reads it.

- A member admitted later joins the running leader, or forks at once from the latent the group recorded at step
  `k` (kept while any member of the group is running; a member admitted after a weight update has another key, so
  it never forks from a latent older weights made).
- A follower's steps before `k` are its leader's, and so are their weight versions (`step_versions`): a weight update
  with `partial=True` may land while the leader runs the prefix, and the follower records what really made its latent.
- A leader that leaves before step `k` (aborted, failed) hands its latent, solver history and step to its first
  follower, which leads on: no follower loses a step, and no follower waits for a leader that is gone.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Optional, Union

import torch

from omniroll.engine.request import RequestState
from omniroll.sampling.solvers import SolverState


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

    With prefix sharing, followers of a group's leader (`PrefixSharing`, below) are running but run no forward
    until their fork; they keep their rows reserved, so a group never exceeds `max_batch_size` once it forks.
    """

    def __init__(self, max_batch_size: Union[int, Callable[[RequestState], int]], prefix_sharing: bool = True):
        self._rows_of = max_batch_size if callable(max_batch_size) else (lambda state: max_batch_size)
        self.key_rows: dict[tuple, int] = {}  # batch key -> its row budget
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.prefix = PrefixSharing() if prefix_sharing else None
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
        admitted, kept, full = [], deque(), set()
        for state in self.waiting:
            key = state.batch_key
            if key not in full and rows[key] + state.num_rows <= self.max_batch_size_for(state):
                rows[key] += state.num_rows
                admitted.append(state)
            else:
                full.add(key)  # FCFS within a key: nothing of this key overtakes the request that did not fit
                kept.append(state)
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


#: sampling fields that act only from the SDE window on, or not on the denoising at all: samples that differ in them
#: still share their ODE prefix. Every other field (a new one too) is part of the prefix key.
AFTER_PREFIX = frozenset({"noise_level", "sde_type", "sde_window_size", "sde_window_range", "logprobs", "output_type",
                          "fps"})


def prefix_key(state: RequestState) -> Optional[tuple]:
    """What a shared prefix depends on; None when the sample has no prefix to share."""
    p, r = state.params, state.request
    if p.latent_seed is None or state.window[0] == 0:
        return None
    return (repr(r.prompt), repr(r.negative_prompt), tuple(state.latents.shape), state.window[0],
            state.admitted_version, tuple(sorted(p.model_dump(exclude=AFTER_PREFIX).items())))


class _Group:
    def __init__(self, leader: RequestState, fork_step: int):
        self.leader: Optional[RequestState] = leader
        self.fork_step = fork_step
        self.followers: list[RequestState] = []
        self.members: set[int] = {id(leader)}
        self.fork_latents: Optional[torch.Tensor] = None  # the leader's latent at fork_step, once it got there
        self.fork_solver_state = SolverState()  # and its solver history then
        self.fork_versions: list[int] = []  # the weight versions of the leader's steps before fork_step


class PrefixSharing:
    """Tracks prefix groups among the running requests (used by the Scheduler)."""

    def __init__(self):
        self._groups: dict[tuple, _Group] = {}
        self._key_of: dict[int, Optional[tuple]] = {}  # id(state) -> its group key (None: not sharing)
        self._following: set[int] = set()
        self.steps_saved = 0  # follower steps that did not need a forward

    def is_following(self, state: RequestState) -> bool:
        return id(state) in self._following

    def update(self, running: list[RequestState]) -> None:
        """Register newly running requests, then fork the followers whose leader reached the fork step."""
        for s in running:
            if id(s) not in self._key_of:
                self._join(s)
        for g in self._groups.values():
            if g.fork_latents is None and g.leader is not None and g.leader.step_index >= g.fork_step:
                g.fork_latents = g.leader.latents.clone()
                g.fork_solver_state = g.leader.solver_state.copy()
                g.fork_versions = list(g.leader.step_versions[:g.fork_step])
                for f in g.followers:
                    self._fork(f, g)
                g.followers.clear()

    def _join(self, s: RequestState) -> None:
        key = prefix_key(s) if s.step_index == 0 else None
        self._key_of[id(s)] = key
        if key is None:
            return
        g = self._groups.get(key)
        if g is None or (g.leader is None and g.fork_latents is None):
            self._groups[key] = _Group(s, s.window[0])
            return
        g.members.add(id(s))
        if g.fork_latents is not None:
            self._fork(s, g)
        else:
            g.followers.append(s)
            self._following.add(id(s))

    def _fork(self, s: RequestState, g: _Group) -> None:
        s.latents = g.fork_latents.clone()
        s.solver_state = g.fork_solver_state.copy()
        s.step_index = g.fork_step
        s.step_versions = list(g.fork_versions)
        self._following.discard(id(s))
        self.steps_saved += g.fork_step

    def leave(self, states: list[RequestState]) -> None:
        """These requests left the running set (finished, aborted, failed)."""
        for s in states:
            key = self._key_of.pop(id(s), None)
            g = self._groups.get(key) if key is not None else None
            if g is None:
                continue
            g.members.discard(id(s))
            if id(s) in self._following:
                self._following.discard(id(s))
                g.followers.remove(s)
            elif s is g.leader:
                g.leader = None
                if g.fork_latents is None and g.followers:  # hand over: the first follower leads on from here
                    heir = g.followers.pop(0)
                    self._following.discard(id(heir))
                    heir.latents = s.latents.clone()
                    heir.solver_state = s.solver_state.copy()
                    heir.step_index = s.step_index
                    heir.step_versions = list(s.step_versions)
                    self.steps_saved += s.step_index
                    g.leader = heir
            if not g.members:
                del self._groups[key]

    def clear(self) -> None:
        self._groups.clear()
        self._key_of.clear()
        self._following.clear()
