"""Tree rollouts: a prompt group as a tree that forks at given denoising steps into given numbers of children
(`TreeSpec`), the check that refuses a bad tree before any work (`check_tree`), and its leaves as ordinary requests
(`TreeSpec.leaf_paths`, `TreeSpec.noise_seeds`, `tree_requests`).

A leaf's noise path: every leaf shares the initial noise and the SDE window (`latent_seed`) and the root's noise
(its request `seed` draws the window's noise before the first fork); from fork step `fork_steps[d]` on, its noise
comes from the seed of its node at depth d + 1 (`noise_seeds`). So a leaf is an ordinary request: run alone it gives
the same sample, bitwise, as inside its tree, where the engine computes each node's steps once for all its
descendants (`omniroll.engine.prefix_tree`). A leaf's tree position is its path: the child taken at each fork.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omniroll.engine.params import GenerationRequest, SamplingParams
from omniroll.sampling.seeds import derive_group_seed, derive_tree_seed


class TreeSpec(BaseModel):
    """Where a group forks and into how many children: `fork_steps[d]` (denoising steps, strictly increasing) and
    `widths[d]` (>= 2) per level; the leaves, `prod(widths)`, are the group's samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fork_steps: tuple[int, ...] = Field(min_length=1, description="the denoising steps the tree forks at, strictly "
                                        "increasing, each inside every SDE window the sampling can draw")
    widths: tuple[int, ...] = Field(min_length=1, description="children per node at each fork (>= 2); their product "
                                    "is the group size n")

    @model_validator(mode="after")
    def _check_shape(self):
        if len(self.widths) != len(self.fork_steps):
            raise ValueError(f"widths: one width per fork step, got {len(self.widths)} widths for "
                             f"{len(self.fork_steps)} fork_steps")
        for d, w in enumerate(self.widths):
            if isinstance(w, bool) or w < 2:
                raise ValueError(f"widths[{d}] must be >= 2 (a fork into one child shares nothing), got {w!r}")
        for d, f in enumerate(self.fork_steps):
            if isinstance(f, bool) or f < 1:
                raise ValueError(f"fork_steps[{d}] must be >= 1 (a fork at step 0 is independent samples that share "
                                 f"their initial noise: same_latent), got {f!r}")
            if d and f <= self.fork_steps[d - 1]:
                raise ValueError(f"fork_steps must be strictly increasing, got {list(self.fork_steps)} "
                                 f"(fork_steps[{d}] = {f} <= fork_steps[{d - 1}])")
        return self

    @property
    def leaves(self) -> int:
        return math.prod(self.widths)

    def leaf_paths(self) -> list[tuple[int, ...]]:
        """Every leaf's path (the child taken at each fork), in group order: leaf i is the i-th path."""
        return list(itertools.product(*(range(w) for w in self.widths)))

    def noise_seeds(self, path: tuple[int, ...], node_seed: Callable[[tuple[int, ...]], int]
                    ) -> tuple[tuple[int, int], ...]:
        """The leaf's `noise_seeds`: from `fork_steps[d]` on, the seed of its node `path[:d + 1]`."""
        return tuple((f, int(node_seed(tuple(path[:d + 1])))) for d, f in enumerate(self.fork_steps))


def forkable_steps(params: SamplingParams) -> tuple[int, int]:
    """[a, b): the steps inside every SDE window `params` can draw (where a tree can fork); empty when a < b fails."""
    lo, hi = params.window_range()
    if params.sde_window_size is None:
        return lo, hi
    return hi - params.sde_window_size, lo + params.sde_window_size


def check_tree(tree: TreeSpec, params: SamplingParams, group_size: Optional[int] = None, field: str = "tree") -> None:
    """ValueError naming `field.<key>` unless every fork can give its children different noise: the widths multiply
    to `group_size` (when given), the sampling is stochastic, and each fork step is inside the schedule and inside
    every SDE window the sampling can draw."""
    if group_size is not None and tree.leaves != group_size:
        raise ValueError(f"{field}.widths: their product is the group size, got {list(tree.widths)} -> {tree.leaves} "
                         f"leaves for n = {group_size}")
    if not params.stochastic:
        raise ValueError(f"{field}: the sampling is an ODE (noise_level {params.noise_level}, sde_type "
                         f"{params.sde_type!r}): no noise can differ between branches")
    T = params.num_inference_steps
    a, b = forkable_steps(params)
    for d, f in enumerate(tree.fork_steps):
        if f >= T:
            raise ValueError(f"{field}.fork_steps[{d}]: step {f} is outside the schedule (num_inference_steps {T}: "
                             f"steps 0-{T - 1})")
        if not a <= f < b:
            where = f"steps [{a}, {b})" if a < b else "no step"
            raise ValueError(f"{field}.fork_steps[{d}]: step {f} is outside the SDE window (every window of size "
                             f"{params.sde_window_size} drawn in {params.window_range()} covers {where}): an ODE step "
                             f"draws no noise, so its branches could not differ")


def tree_requests(tree: TreeSpec, params: SamplingParams, seed: int, id_prefix: str = "leaf",
                  node_seed: Optional[Callable[[tuple[int, ...]], int]] = None, **request_fields
                  ) -> list[GenerationRequest]:
    """The leaves of one tree as requests (checked by `check_tree` first), in `leaf_paths` order, ids
    `{id_prefix}/{path}`: the initial noise from `derive_group_seed(seed, 0, id_prefix)` (unless `params` sets
    `latent_seed`), node seeds `node_seed(path)` (default `derive_tree_seed(seed, 0, id_prefix, path)`; the root's is
    every leaf's request `seed`). `request_fields`: the prompt and the other `GenerationRequest` fields."""
    check_tree(tree, params)
    node_seed = node_seed or (lambda path: derive_tree_seed(seed, 0, id_prefix, path))
    latent_seed = params.latent_seed if params.latent_seed is not None else derive_group_seed(seed, 0, id_prefix)
    out = []
    for path in tree.leaf_paths():
        sp = SamplingParams.model_validate({**params.model_dump(), "latent_seed": latent_seed,
                                            "noise_seeds": tree.noise_seeds(path, node_seed)})
        out.append(GenerationRequest(request_id=f"{id_prefix}/{'.'.join(map(str, path))}", seed=node_seed(()),
                                     sampling_params=sp, **request_fields))
    return out
