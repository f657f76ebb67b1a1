"""Group prefix sharing: samples that share their initial noise run their common ODE prefix once.

Samples with the same `latent_seed` (flow_grpo's `same_latent`), prompt, negative prompt, latent shape, schedule,
guidance, text length and weight version at admission have the same initial latent and the same SDE window start `k`; every step
before `k` is the same deterministic ODE step for all of them (no noise is drawn outside the window). One member,
the leader, runs those steps; the others (followers) run no forward until the leader reaches step `k`, then each
takes a copy of the leader's latent and goes on alone from step `k`, drawing its own window noise. The steps are the
same computation on the same inputs, so in batch-invariant mode every output is bitwise identical to running the
sample alone (tested); the trainer needs nothing new.

- A member admitted later joins the running leader, or forks at once from the latent the group recorded at step
  `k` (kept while any member of the group is running; a member admitted after a weight update has another key, so
  it never forks from a latent older weights made).
- A follower's steps before `k` are its leader's, and so are their weight versions (`step_versions`): a weight update
  with `partial=True` may land while the leader runs the prefix, and the follower records what really made its latent.
- A leader that leaves before step `k` (aborted, failed) hands its latent and step to its first follower, which
  leads on: no follower loses a step, and no follower waits for a leader that is gone.
"""

from __future__ import annotations

from typing import Optional

import torch

from omniroll.engine.request import RequestState


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
