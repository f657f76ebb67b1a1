"""`Algorithm`: what the trainer loop asks of a training algorithm, and nothing else. One subclass per algorithm, one
file each; the loop (omniroll/train/trainer.py) never branches on an algorithm's name.

A step, as the loop drives it:

    overrides = algo.sampling_overrides(step)           # what its rollout asks the engine for
    rows      = algo.rows(batch, policy.adapter)          # TrajectoryBatch (SDE window) or CleanBatch (clean x0)
    adv       = algo.advantages(rewards, groups)
    metrics   = algo.prepare(policy, rows, plan)          # anchors computed before the inner epochs
    for each micro-batch, for term in range(algo.num_terms(mb)):
        algo.loss(policy, mb, idx, adv[idx], term, plan).loss.backward()   (omniroll/train/update.py)
    metrics  |= algo.after_update(policy, step)           # e.g. NFT's old-adapter decay
    with algo.sampling_weights(policy): sync              # the weights the replicas sample with

Its configuration (options with the reference defaults, which shared `trainer.*` keys it reads, the rollout it
needs) is declared in omniroll/config/algorithms.py.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional

import torch

from omniroll.sampling.seeds import noise_term_seed, shuffle_seed
from omniroll.train.advantages import Advantages, group_advantages
from omniroll.train.algorithms.ppo import LossTerms


@dataclass
class UpdatePlan:
    """How the step's update runs (the inner loop's settings an algorithm may need to plan its anchors). per_update:
    micro-batches per optimizer step (None: one step per inner epoch); versions: [B, W] the weight version behind
    each row's window steps (forward-process rows: [B, 1]); store: the `VersionStore` of the kept versions; halves:
    bool [B], the gradient-signal meter's half A (omniroll/train/grad_signal.py: micro-batches are cut half by half),
    None for no split; signal: whether the meter reads the halves' gradients this step."""

    step: int
    seed: int
    micro_batch_size: int
    per_update: Optional[int] = None
    versions: Optional[torch.Tensor] = None
    store: Any = None
    decoupled: bool = False
    halves: Optional[torch.Tensor] = None
    signal: bool = False

    def epoch(self, B: int, epoch: int):
        """The micro-batches of inner epoch `epoch` over B rows (`omniroll.train.micro_batches.EpochPlan`)."""
        from omniroll.train.micro_batches import epoch_micro_batches

        return epoch_micro_batches(B, self.halves, self.micro_batch_size, self.per_update,
                                   shuffle_generator(self.seed, self.step, epoch))


def shuffle_generator(seed: int, step: int, epoch: int) -> torch.Generator:
    """Shuffling depends only on (seed, step, epoch): a resumed run shuffles exactly as a straight one."""
    return torch.Generator().manual_seed(shuffle_seed(seed, step, epoch))


def term_generator(seed: int, step: int, epoch: int, chunk: int, term: int) -> torch.Generator:
    """Fresh noise of one loss term (forward-process algorithms): a function of (seed, step, epoch, micro-batch, term)
    only, so a resumed run draws exactly as a straight one."""
    return torch.Generator().manual_seed(noise_term_seed(seed, step, epoch, chunk, term))


class Algorithm(ABC):
    """config: the whole OmniRollConfig (its `trainer` section chose this algorithm); adapter: the trainer's model
    (what its family takes, e.g. how CFG is turned off)."""

    name: ClassVar[str]

    def __init__(self, config, adapter):
        self.config = config
        self.adapter = adapter
        self.tc = config.trainer
        self.options = self.tc.options()

    # ------------------------------------------------------------------ the rollout
    @abstractmethod
    def sampling_overrides(self, step: int) -> dict:
        """SamplingParams fields laid over the config's for this step's rollout."""

    @abstractmethod
    def rows(self, batch, adapter):
        """The batch's rows as the loss needs them (TrajectoryBatch or CleanBatch)."""

    # ------------------------------------------------------------------ advantages
    def advantages(self, rewards: torch.Tensor, groups) -> Advantages:
        return group_advantages(rewards, groups, self.tc.global_std, self.tc.adv_clip_max)

    # ------------------------------------------------------------------ the update
    def prepare(self, policy, rows, plan: UpdatePlan) -> dict:
        """Before the inner epochs (anchors, per-row draws). Returns metrics for the step's record."""
        return {}

    @abstractmethod
    def num_terms(self, mb) -> int:
        """Loss terms per micro-batch (window steps, training timesteps)."""

    @abstractmethod
    def loss(self, policy, mb, idx: torch.Tensor, adv: torch.Tensor, term: int, plan: UpdatePlan, *,
             epoch: int, chunk: int, first_update: bool) -> LossTerms:
        """One loss term of micro-batch `mb` (rows `idx` of the step's batch, advantages `adv`)."""

    def after_update(self, policy, step: int) -> dict:
        """After the step's last optimizer update, before the sync. Returns metrics."""
        return {}

    @contextlib.contextmanager
    def sampling_weights(self, policy) -> Iterator[None]:
        """The policy holds the weights the replicas sample with inside the block (default: the trained ones)."""
        yield

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None
