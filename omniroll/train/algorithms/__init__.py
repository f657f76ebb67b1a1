"""The training algorithms, one file each (omniroll/train/algorithms/base.py says what the trainer asks of them), on
the SDE window's exact log-probs (`flow_grpo` and the files built on it) or on the forward process's clean latents
(forward.py's `ForwardProcessAlgorithm`: `nft`, `awm`, `online_dpo`). Their configuration is declared in
omniroll/config/algorithms.py, whose `ALGORITHMS` is the one list of them: the class of `trainer.algorithm: NAME` is
the `Algorithm` subclass named NAME in this package's module NAME (`algorithm_class`); `make_algorithm` builds the
chosen one.
"""

import importlib

from omniroll.config.algorithms import ALGORITHMS
from omniroll.train.algorithms.awm import AWM
from omniroll.train.algorithms.base import Algorithm, UpdatePlan
from omniroll.train.algorithms.dance_grpo import DanceGRPO
from omniroll.train.algorithms.flow_grpo import FlowGRPO
from omniroll.train.algorithms.grpo_guard import GRPOGuard
from omniroll.train.algorithms.nft import NFT
from omniroll.train.algorithms.tree_grpo import TreeGRPO


def algorithm_class(name: str) -> type[Algorithm]:
    """The `Algorithm` subclass of registered algorithm `name`: the one in omniroll/train/algorithms/<name>.py whose
    `name` is `name` (ValueError when the file holds none)."""
    if name not in ALGORITHMS:
        raise ValueError(f"trainer.algorithm: one of {list(ALGORITHMS)}, got {name!r}")
    module = importlib.import_module(f"{__name__}.{name}")
    found = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, Algorithm) and getattr(c, "name", None) == name]
    if len(found) != 1:
        raise ValueError(f"trainer.algorithm {name}: omniroll/train/algorithms/{name}.py must define one Algorithm "
                         f"subclass with name = {name!r}, found {len(found)}")
    return found[0]


#: trainer.algorithm -> its class, for every registered algorithm (omniroll/config/algorithms.py `ALGORITHMS`)
REGISTRY: dict[str, type[Algorithm]] = {name: algorithm_class(name) for name in ALGORITHMS}


def make_algorithm(config, adapter) -> Algorithm:
    """The algorithm `config.trainer.algorithm` names, for the trainer's model `adapter`. An algorithm that cuts its
    own micro-batches (`Algorithm.micro_batches`) trains in one process only: the data-parallel driver plans every
    rank's optimizer steps from the default cut (omniroll/train/parallel/shard.py `rows_per_update`)."""
    cls = REGISTRY[config.trainer.algorithm]
    if config.trainer.world_size > 1 and cls.micro_batches is not Algorithm.micro_batches:
        raise ValueError(f"trainer.world_size: {config.trainer.algorithm} cuts its own micro-batches "
                         f"(Algorithm.micro_batches), which the data-parallel trainer does not plan yet: world_size "
                         f"must be 1 for it, got {config.trainer.world_size}")
    return cls(config, adapter)


__all__ = ["AWM", "Algorithm", "DanceGRPO", "FlowGRPO", "GRPOGuard", "NFT", "REGISTRY", "TreeGRPO",
           "UpdatePlan", "algorithm_class", "make_algorithm"]
