"""Rewards through verl's `RewardLoopWorker`, both ends.

- `VerlRewardPool`: what omniroll's verl worker streams finished samples to. It sends each sample to a random
  `RewardLoopWorker` as the one-row DataProto verl's own agent loop sends (`responses` = the uint8 image [1, 3, H, W],
  `raw_prompt`, `data_source`, `reward_model`, `extra_info`, `meta_info.validate`) and turns the reply
  `{reward_score, reward_extra_info}` into a `RewardResult`; a missing or non-finite score is a failed row, never 0.
- `OmnirollImageRewardManager`: a verl reward manager (registered as `omniroll_image`: set
  `reward.reward_manager.name=omniroll_image`) that scores such an image row with the user's
  `reward.custom_reward_function` called as VeRL-Omni's visual rewards are:
  `compute_score(data_source=, solution_image=, ground_truth=, extra_info=)` -> float or {"score": float, ...}.
  verl's RewardLoopWorker loads a tokenizer from `actor_rollout_ref.model.tokenizer_path`: point it at the
  checkpoint's `tokenizer` folder.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import time
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER, register

from omniroll.agent_loop.loop import prompt_text
from omniroll.reward import RewardResult, RewardSample

REWARD_MANAGER_NAME = "omniroll_image"


def sample_to_dataproto(sample: RewardSample, validate: bool = False) -> DataProto:
    image = torch.from_numpy(np.ascontiguousarray(sample.image))[None]
    obj = lambda v: np.array([v], dtype=object)  # noqa: E731
    return DataProto.from_dict(
        tensors={"responses": image, "prompts": torch.zeros(1, 1, dtype=torch.int64),
                 "attention_mask": torch.ones(1, 1, dtype=torch.int64)},
        non_tensors={"raw_prompt": obj(sample.prompt), "data_source": obj(sample.data_source),
                     "reward_model": obj({"ground_truth": sample.ground_truth}), "extra_info": obj(sample.extra_info),
                     "uid": obj(sample.sample_id)},
        meta_info={"validate": validate})


class VerlRewardPool:
    """omniroll's reward-pool interface (`await score(RewardSample)`) over verl RewardLoopWorker handles."""

    def __init__(self, handles: list):
        if not handles:
            raise ValueError("VerlRewardPool needs at least one RewardLoopWorker handle")
        self.handles = list(handles)

    async def score(self, sample: RewardSample) -> RewardResult:
        started = time.time()
        reply = await random.choice(self.handles).compute_score.remote(sample_to_dataproto(sample))
        score = reply.get("reward_score") if isinstance(reply, dict) else None
        info = dict(reply.get("reward_extra_info") or {}) if isinstance(reply, dict) else {}
        done = time.time()
        if isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
            return RewardResult(sample.sample_id, float(score), extra_info=info, started_at=started, finished_at=done)
        return RewardResult(sample.sample_id, None, extra_info=info, status="failed", started_at=started,
                            finished_at=done, error=f"reward worker returned no finite reward_score: {score!r}")


class OmnirollImageRewardManager(RewardManagerBase):
    def __init__(self, config: Any, tokenizer: Any, compute_score: Any, **kwargs):
        super().__init__(config, tokenizer, compute_score)  # reward_router_address etc.: no use for images

    async def run_single(self, data: DataProto) -> dict:
        if self.compute_score is None:
            raise ValueError("reward.reward_manager.name=omniroll_image needs reward.custom_reward_function.path")
        if len(data) != 1:
            raise ValueError(f"run_single takes one row, got {len(data)}")
        nt = data.non_tensor_batch
        image = data.batch["responses"][0].cpu().numpy()
        rm = nt["reward_model"][0] if "reward_model" in nt else None
        kwargs = dict(data_source=str(nt["data_source"][0]) if "data_source" in nt else "", solution_image=image,
                      ground_truth=rm.get("ground_truth") if isinstance(rm, dict) else None,
                      extra_info={**dict(nt["extra_info"][0] or {}), "prompt": prompt_text(nt["raw_prompt"][0])}
                      if "extra_info" in nt else {"prompt": prompt_text(nt["raw_prompt"][0])})
        if inspect.iscoroutinefunction(self.compute_score):
            result = await self.compute_score(**kwargs)
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, lambda: self.compute_score(**kwargs))
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"compute_score returned a dict without 'score': {sorted(result)}")
            info = {k: v for k, v in result.items() if k != "score"}
            return {"reward_score": float(result["score"]), "reward_extra_info": info}
        return {"reward_score": float(result), "reward_extra_info": {}}


if REWARD_MANAGER_NAME not in REWARD_MANAGER:
    register(REWARD_MANAGER_NAME)(OmnirollImageRewardManager)
