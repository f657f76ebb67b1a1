"""Shared prefixes at every fork of a group or a tree: samples whose first k steps are the same computation run them
once, on one leader, and the others take a copy of its state at the fork (`PrefixTree`, the Scheduler's).

Which samples share which steps (`fork_points`): a sample with `latent_seed` belongs to a chain of nested groups,
each with a fork step and a key that fixes everything its steps before the fork depend on:

- depth 0, the ODE prefix (flow_grpo's `same_latent`): fork at the SDE window's start `w`; key: latent seed, prompt,
  negative prompt, latent shape, window start, weight version at admission and every sampling field that acts before
  the window (`AFTER_PREFIX` lists those that do not). No noise is drawn before `w`.
- depth d >= 1, a tree's branches (`noise_seeds`): fork at the d-th `noise_seeds` step `f` (inside the window, after
  `w`); key: the depth-0 key, the window, the request's `seed`, the `noise_seeds` pairs before `f` and every other
  sampling field. Its members draw the same noise on `[w, f)` and record the same steps.

A running sample follows (runs no forward) while some group of its chain that it has not passed is led by another
sample; it waits on the deepest such group. When that group's leader reaches the fork, the group keeps a snapshot of
its state (`RequestState.prefix_state`: latent, solver history, step versions, recorded steps) and each waiting
member takes a copy (`take_prefix`) and goes on from the fork step, leading every deeper group of its own; a member
admitted later forks at once from the kept snapshot (kept while any member runs; a member admitted after a weight
update has another key, so it never forks from a latent older weights made). At a fork each member draws from the
fork on with its own noise generator: at depth 0 its own seed, which drew nothing yet; at depth d the d-th
`noise_seeds` seed, which starts there. So every sample is bitwise what it gives when run alone (tested).

A leader that leaves before its fork: aborted, it hands its state to the first member to ask (with its noise
generator's state at depth >= 1, which every member shares), which leads on: no member loses a step or waits for a
leader that is gone. Failed (`fail`), the prefix it was computing failed: every member still before that fork fails
with it (the subtree), each named by the scheduler to its caller.
"""

from __future__ import annotations

from typing import Optional

from omniroll.engine.request import PrefixState, RequestState

#: sampling fields that act only from the SDE window on, or not on the denoising at all: samples that differ in them
#: still share their ODE prefix. Every other field (a new one too) is part of the prefix key.
AFTER_PREFIX = frozenset({"noise_level", "sde_type", "sde_window_size", "sde_window_range", "logprobs", "output_type",
                          "fps", "noise_seeds"})
#: sampling fields that do not act on the denoised latents or what is recorded: a tree's branches differ in them
AFTER_FORK = frozenset({"output_type", "fps", "noise_seeds"})


def _base_key(state: RequestState) -> tuple:
    p, r = state.params, state.request
    return (repr(r.prompt), repr(r.negative_prompt), repr(r.prompt_token_ids), repr(r.negative_prompt_token_ids),
            tuple(state.latents.shape), state.window[0], state.admitted_version,
            tuple(sorted(p.model_dump(exclude=AFTER_PREFIX).items())))


def fork_points(state: RequestState) -> list[tuple[tuple, int, bool]]:
    """The sample's groups, shallow to deep: (key, fork step, whether its members share noise draws)."""
    p = state.params
    if p.latent_seed is None:
        return []
    points = []
    base = _base_key(state)
    if state.window[0] > 0:
        points.append((("ode",) + base, state.window[0], False))
    after = tuple(sorted(p.model_dump(exclude=AFTER_FORK).items()))
    seeds = tuple(tuple(x) for x in (p.noise_seeds or ()))
    for d, (step, _) in enumerate(seeds):
        if step > state.window[0]:
            points.append((("branch",) + base + (tuple(state.window), int(state.request.seed), seeds[:d], after),
                           step, True))
    return points


class _Group:
    def __init__(self, leader: RequestState, fork_step: int, with_noise: bool):
        self.leader: Optional[RequestState] = leader
        self.fork_step = fork_step
        self.with_noise = with_noise
        self.members: set[int] = set()
        self.snapshot: Optional[PrefixState] = None  # the leader's state at fork_step, once it got there
        self.handover: Optional[PrefixState] = None  # a leader that left before the fork: its last state


class PrefixTree:
    """Tracks the prefix groups among the running requests (used by the Scheduler)."""

    def __init__(self):
        self._groups: dict[tuple, _Group] = {}
        self._chain: dict[int, list[tuple]] = {}  # id(state) -> its group keys, shallow to deep
        self._following: set[int] = set()
        self.steps_saved = 0  # steps members did not run themselves (a fork, a hand-over)

    def is_following(self, state: RequestState) -> bool:
        return id(state) in self._following

    def update(self, running: list[RequestState]) -> None:
        """Register newly running requests, keep the fork state of groups whose leader reached the fork, then fork
        (or hand over to) each member that can go on."""
        for s in running:
            if id(s) not in self._chain:
                self._join(s)
        for g in self._groups.values():
            if g.snapshot is None and g.leader is not None and g.leader.step_index >= g.fork_step:
                g.snapshot = g.leader.prefix_state(g.with_noise)
        for s in running:
            self._settle(s)

    def _join(self, s: RequestState) -> None:
        keys = []
        for key, fork_step, with_noise in (fork_points(s) if s.step_index == 0 else []):
            g = self._groups.get(key)
            if g is None or (g.leader is None and g.snapshot is None and g.handover is None):
                g = self._groups[key] = _Group(s, fork_step, with_noise)
            g.members.add(id(s))
            keys.append(key)
        self._chain[id(s)] = keys

    def _ahead(self, s: RequestState) -> list[_Group]:
        """The groups of `s` whose fork it has not passed, shallow to deep."""
        return [g for g in (self._groups[k] for k in self._chain.get(id(s), ())) if g.fork_step > s.step_index]

    def _settle(self, s: RequestState) -> None:
        while True:
            others = [g for g in self._ahead(s) if g.leader is not s]
            if not others:
                self._following.discard(id(s))
                return
            g = others[-1]  # the deepest group another sample computes for s
            if g.snapshot is not None:
                self._take(s, g.snapshot)
            elif g.leader is None:  # its leader left before the fork: s leads on, from its last state if further
                g.leader = s
                if g.handover is not None and g.handover.step_index > s.step_index:
                    self._take(s, g.handover)
            else:
                self._following.add(id(s))
                return

    def _take(self, s: RequestState, state: PrefixState) -> None:
        self.steps_saved += state.step_index - s.step_index
        s.take_prefix(state)

    def leave(self, states: list[RequestState]) -> None:
        """These requests left the running set (finished, aborted): a leader before its fork hands over."""
        for s in states:
            for g in self._leave(s):
                if s.step_index >= g.fork_step:
                    g.snapshot = s.prefix_state(g.with_noise)
                else:
                    g.handover = s.prefix_state(g.with_noise)

    def fail(self, states: list[RequestState], running: list[RequestState]) -> dict[int, RequestState]:
        """These requests failed and left the running set: each member of `running` still before the fork of a
        prefix a failed one was computing fails with it. Returns id(member) -> the failed request it depended on
        (the caller takes those members out of the running set and fails them)."""
        doomed: dict[int, RequestState] = {}
        for s in states:
            if id(s) in doomed:
                continue
            for g in self._leave(s):
                if s.step_index >= g.fork_step:
                    g.snapshot = s.prefix_state(g.with_noise)
                    continue
                for m in running:
                    if id(m) in g.members and m.step_index < g.fork_step and id(m) not in doomed:
                        doomed[id(m)] = s
        return doomed

    def _leave(self, s: RequestState) -> list[_Group]:
        """Take `s` out of its groups; returns the groups it led that have no fork state yet."""
        led = []
        self._following.discard(id(s))
        for key in self._chain.pop(id(s), ()):
            g = self._groups.get(key)
            if g is None:
                continue
            g.members.discard(id(s))
            if g.leader is s:
                g.leader = None
                if g.snapshot is None:
                    led.append(g)
            if not g.members:
                del self._groups[key]
        return led

    def clear(self) -> None:
        self._groups.clear()
        self._chain.clear()
        self._following.clear()
