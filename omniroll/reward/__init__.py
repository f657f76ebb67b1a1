"""Reward side of the rollout: scorers, the `RewardManager`, the micro-batching `RewardLoopWorker` and a pool."""

from omniroll.reward.http import HttpScorer, RewardHTTPError, decode_png_batch, decode_safetensors_batch
from omniroll.reward.manager import RewardConfig, RewardFunctionConfig, RewardManager
from omniroll.reward.pool import RewardPoolError, RewardWorkerPool, create_reward_workers
from omniroll.reward.scorers import (
    SCORER_REGISTRY,
    build_scorer,
    jpeg_compressibility,
    jpeg_incompressibility,
    load_function,
    per_sample_to_batch,
    register_scorer,
)
from omniroll.reward.types import RewardResult, RewardSample
from omniroll.reward.worker import RewardLoopWorker

__all__ = [
    "HttpScorer",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardHTTPError",
    "RewardLoopWorker",
    "RewardManager",
    "RewardPoolError",
    "RewardResult",
    "RewardSample",
    "RewardWorkerPool",
    "SCORER_REGISTRY",
    "build_scorer",
    "create_reward_workers",
    "decode_png_batch",
    "decode_safetensors_batch",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "load_function",
    "per_sample_to_batch",
    "register_scorer",
]
