"""`step_prompt_batch`: what a training step rolls out: `trainer.prompts_per_step` of the training prompts, drawn from
(seed, step) only (a resumed run draws what a straight one did), each `n` times, with the algorithm's sampling
overrides for the step (its SDE window, CFG off, no log-probs) in the batch's `meta_info`."""

from __future__ import annotations

import torch

from omniroll.agent_loop.batch import DataBatch, prompt_batch
from omniroll.sampling.seeds import batch_prompt_uid, prompt_order_seed


def step_prompt_batch(prompts: list[str], n: int, prompts_per_step: int, seed: int, step: int, rollout_seed: int,
                      overrides: dict) -> DataBatch:
    """Step `step`'s prompt batch (module doc); uid: the prompt's index in `prompts` (the same function as the CLI's
    position uid)."""
    g = torch.Generator().manual_seed(prompt_order_seed(seed, step))
    picks = torch.randperm(len(prompts), generator=g)[:prompts_per_step].tolist()
    meta = {"global_steps": step, "rollout_seed": rollout_seed}
    if overrides:
        meta["sampling_params"] = overrides
    return prompt_batch(prompts, n, batch_prompt_uid, indices=picks, data_source="train", meta_info=meta)
