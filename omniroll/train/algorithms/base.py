"""`Algorithm`: what the trainer loop asks of a training algorithm, and nothing else. One subclass per algorithm, one
file each; the loop (omniroll/train/trainer.py) never branches on an algorithm's name.

A step, as the loop drives it:

    overrides = algo.sampling_overrides(step)           # what its rollout asks the engine for
    rows      = algo.rows(batch, policy.adapter)          # TrajectoryBatch (SDE window) or CleanBatch (clean x0)
    adv       = algo.advantages(rewards, groups, batch)   # batch: its reward components (reward.aggregation gdpo)
    anchors   = algo.prepare(policy, rows, plan)          # its declared `Anchors`, computed before the inner epochs
    for each epoch, for each micro-batch of algo.micro_batches(rows, plan, epoch),
        for term in range(algo.num_terms(mb, anchors)):
            algo.loss(LossInput(policy, mb, idx, adv[idx], term, anchors, plan, ...)).loss.backward()
                                                                          (omniroll/train/update.py)
    metrics   = anchors.metrics | algo.after_update(policy, step)   # e.g. NFT's old-adapter decay
    with algo.sampling_weights(policy): sync              # the weights the replicas sample with

`prepare` hands what it computes to `loss` only through the `Anchors` it returns (each algorithm declares its own
subclass: Flow-GRPO's window steps and behaviour / proximal log-probs, the forward-process algorithms' training
timesteps), never through attributes set on the algorithm; `loss` reads them and writes nothing (its inputs and
result: omniroll/train/algorithms/terms.py). What an algorithm keeps across steps (NFT's old weights) is its state
(`state_dict`).

Its configuration and facts (options with the reference defaults, which shared `trainer.*` keys it reads, the rollout
it needs, whether FSDP runs it, whether its stale loss is decoupled) are declared in omniroll/config/algorithms.py
(`self.spec`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch

from omniroll.config.algorithms import ALGORITHMS, AlgorithmSpec
from omniroll.sampling.seeds import noise_term_seed, shuffle_seed
from omniroll.train.advantages import Advantages, batch_components, gdpo_advantages, group_advantages
from omniroll.train.algorithms.terms import LossInput, LossTerms
from omniroll.train.micro_batches import EpochPlan, epoch_micro_batches


@dataclass
class UpdatePlan:
    """How the step's update runs (the inner loop's settings an algorithm may need to plan its anchors). per_update:
    micro-batches per optimizer step (None: one step per inner epoch); versions: [B, W] the weight version behind
    each row's window steps (forward-process rows: [B, 1]); store: the `VersionStore` of the kept versions; halves:
    bool [B], the gradient-signal meter's half A (omniroll/train/grad_signal.py: micro-batches are cut half by half),
    None for no split; signal: whether the meter reads the halves' gradients this step; groups: long [B], each row's
    prompt group (`micro_batches.group_index`: the order of first appearance), for an algorithm that keeps a group in
    one micro-batch (None: not known); components: {reward function: its own advantages [B]} for the meter per
    component (`trainer.signal_components`, omniroll/train/component_signal.py; read when `signal`), None: off;
    kl_gate: float [B] of 0 / 1, the rows whose KL counts (`trainer.kl_gate`, omniroll/train/kl_gate.py), None: all;
    data_term: optimizer step u -> (weighted loss, its unweighted value) of the data regulariser
    (`trainer.data_regularizer`, omniroll/train/data_regularizer.py), None: off."""

    step: int
    seed: int
    micro_batch_size: int
    per_update: Optional[int] = None
    versions: Optional[torch.Tensor] = None
    store: Any = None
    halves: Optional[torch.Tensor] = None
    signal: bool = False
    groups: Optional[torch.Tensor] = None
    components: Optional[dict] = None
    kl_gate: Optional[torch.Tensor] = None
    data_term: Optional[Callable] = None

    def epoch(self, B: int, epoch: int) -> EpochPlan:
        """The default micro-batches of inner epoch `epoch` over B rows: shuffled one by one, cut half by half of the
        meter's split (`omniroll.train.micro_batches.epoch_micro_batches`)."""
        return epoch_micro_batches(B, self.halves, self.micro_batch_size, self.per_update,
                                   shuffle_generator(self.seed, self.step, epoch))


@dataclass
class Anchors:
    """What `prepare` computes before the inner epochs and `loss` reads: each algorithm declares a subclass with its
    fields (per-row tensors, indexed by the step's row indices); `metrics`: its entries for the step's record."""

    metrics: dict = field(default_factory=dict)


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

    name: ClassVar[str]  # its `trainer.algorithm` name: the name of its file and of its `ALGORITHMS` entry

    def __init__(self, config, adapter):
        self.config = config
        self.adapter = adapter
        self.tc = config.trainer
        self.options = self.tc.options()
        self.spec: AlgorithmSpec = ALGORITHMS[self.name]  # its declared facts (omniroll/config/algorithms.py)

    @property
    def title(self) -> str:
        """Its name as papers and plots write it, e.g. 'Flow-GRPO' (`AlgorithmSpec.title`)."""
        return self.spec.title

    # ------------------------------------------------------------------ the rollout
    @abstractmethod
    def sampling_overrides(self, step: int) -> dict:
        """SamplingParams fields laid over the config's for this step's rollout."""

    def rollout_guidance(self) -> dict:
        """The guidance fields its rollout lays over the pipeline's ({}: the pipeline's CFG): the regime it trains,
        which the validation grid draws at too (`train/report/validation.py`)."""
        return {}

    @abstractmethod
    def rows(self, batch, adapter):
        """The batch's rows as the loss needs them (TrajectoryBatch or CleanBatch)."""

    # ------------------------------------------------------------------ advantages
    def advantages(self, rewards: torch.Tensor, groups, batch=None) -> Advantages:
        """`reward.aggregation: sum`: the weighted sums `rewards` standardised per group (`group_advantages`);
        `gdpo`: each reward function's score (read from `batch`, the rollout's DataBatch) normalised within its
        group, weighted, whitened over the batch: that is the advantage (`gdpo_advantages` says why it is not
        group-normalised again). The advantages are [B]; a step-level algorithm returns [B, W], one per recorded window
        step (`tree_grpo`: its `loss` picks each term's step)."""
        reward = self.config.reward
        if reward.aggregation == "gdpo":
            if batch is None:
                raise ValueError("reward.aggregation gdpo: the advantages need the rollout batch (each reward "
                                 "function's score per row)")
            names = list(reward.functions)
            return gdpo_advantages(batch_components(batch, names), {k: f.weight for k, f in reward.functions.items()},
                                   groups, rewards, self.tc.adv_clip_max)
        return group_advantages(rewards, groups, self.tc.global_std, self.tc.adv_clip_max)

    # ------------------------------------------------------------------ the update
    def prepare(self, policy, rows, plan: UpdatePlan) -> Anchors:
        """Before the inner epochs: the anchors `loss` reads (behaviour, proximal log-probs, per-row draws) and the
        metrics they add to the step's record."""
        return Anchors()

    def micro_batches(self, rows, plan: UpdatePlan, epoch: int) -> EpochPlan:
        """The micro-batches of inner epoch `epoch` over `rows`, and the optimizer steps they form (default: the rows
        shuffled one by one, `plan.epoch`). A pairwise or group objective (online DPO, DGPO) overrides this to keep a
        pair or a group in one micro-batch: `micro_batches.whole_group_micro_batches(plan.groups, ...)`."""
        return plan.epoch(len(rows), epoch)

    @abstractmethod
    def num_terms(self, mb, anchors: Anchors) -> int:
        """Loss terms per micro-batch (window steps, training timesteps)."""

    @abstractmethod
    def loss(self, inp: LossInput) -> LossTerms:
        """Loss term `inp.term` of micro-batch `inp.mb` (rows `inp.idx` of the step's batch, advantages `inp.adv`, the
        step's read-only `inp.anchors`)."""

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
