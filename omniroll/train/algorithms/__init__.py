"""The training algorithms, one file each (omniroll/train/algorithms/base.py says what the trainer asks of them):
`flow_grpo`, `grpo_guard`, `dance_grpo` (SDE window, exact log-probs) and `nft`, `awm` (forward process, clean
latents). Their configuration is declared in omniroll/config/algorithms.py; `make_algorithm` builds the chosen one.
"""

from omniroll.train.algorithms.awm import AWM
from omniroll.train.algorithms.base import Algorithm, UpdatePlan
from omniroll.train.algorithms.dance_grpo import DanceGRPO
from omniroll.train.algorithms.flow_grpo import FlowGRPO
from omniroll.train.algorithms.grpo_guard import GRPOGuard
from omniroll.train.algorithms.nft import NFT

#: trainer.algorithm -> its class
REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FlowGRPO, GRPOGuard, DanceGRPO, NFT, AWM)}


def make_algorithm(config, adapter) -> Algorithm:
    """The algorithm `config.trainer.algorithm` names, for the trainer's model `adapter`."""
    return REGISTRY[config.trainer.algorithm](config, adapter)


__all__ = ["AWM", "Algorithm", "DanceGRPO", "FlowGRPO", "GRPOGuard", "NFT", "REGISTRY", "UpdatePlan",
           "make_algorithm"]
