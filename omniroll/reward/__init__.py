"""Reward side of the rollout: scorers, the `RewardManager`, the micro-batching `RewardLoopWorker` and a pool."""

from omniroll.reward.http import HttpScorer, RewardHTTPError, decode_png_batch, decode_safetensors_batch
from omniroll.reward.manager import RewardConfig, RewardFunctionConfig, RewardManager
from omniroll.reward.openai_judge import OpenAIJudge
from omniroll.reward.scorers import (
    SCORER_REGISTRY,
    RewardResult,
    RewardSample,
    build_scorer,
    jpeg_compressibility,
    jpeg_incompressibility,
    load_function,
    per_sample_to_batch,
    prompt_colour,
    register_scorer,
)
from omniroll.reward.worker import RewardLoopWorker, RewardPoolError, RewardWorkerPool, create_reward_workers

__all__ = [
    "HttpScorer",
    "OpenAIJudge",
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
    "prompt_colour",
    "register_scorer",
]
