"""omniroll: online RL on flow-matching diffusion models, from the rollout (engine, Ray replicas, streaming rewards,
weight sync) to its own trainer (Flow-GRPO and the other algorithms of `omniroll.config.algorithms.ALGORITHMS`)."""

from omniroll.engine.output import DiffusionOutput
from omniroll.engine.params import GenerationRequest, SamplingParams

__all__ = ["DiffusionOutput", "GenerationRequest", "SamplingParams", "DiffusionEngine"]
__version__ = "0.3.42"


def __getattr__(name):
    if name == "DiffusionEngine":
        from omniroll.engine.engine import DiffusionEngine

        return DiffusionEngine
    raise AttributeError(name)
