"""verl test helpers (imported as tests.verl_helpers, so Ray workers can load the stand-in actor) and a visual reward in
VeRL-Omni's calling convention, which verl's RewardLoopWorker loads from this file."""

import os

import numpy as np
import torch

N, PROMPTS, STEPS, W = 4, 2, 3, 2
HERE = os.path.dirname(os.path.abspath(__file__))


def compute_score(data_source, solution_image, ground_truth=None, extra_info=None):
    image = np.asarray(solution_image)
    assert image.dtype == np.uint8 and image.shape[0] == 3, (image.dtype, image.shape)
    return {"score": float(image.mean()) / 255.0, "brightness": float(image.mean()),
            "prompt_chars": len((extra_info or {}).get("prompt", ""))}


def verl_config(model_path: str):
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    ref, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    ref.model.path = model_path
    ref.model.tokenizer_path = os.path.join(model_path, "tokenizer")  # verl's reward worker loads a tokenizer
    r.name, r.dtype, r.n, r.seed, r.prompt_length = "omniroll", "float32", N, 3, 128
    r.tensor_model_parallel_size, r.agent.num_workers = 1, 2
    r.custom = {"omniroll": {"engine": {"max_batch_size": 8},
                             "pipeline": {"height": 64, "width": 64, "num_inference_steps": STEPS,
                                          "guidance_scale": 4.5, "max_sequence_length": 16},
                             "algo": {"noise_level": 0.7, "sde_window_size": W, "sde_window_range": [0, 2]}}}
    cfg.reward.custom_reward_function.path = os.path.abspath(__file__)
    cfg.reward.reward_manager.source = "importlib"  # works in any process, no registration needed
    cfg.reward.reward_manager.module.path = "pkg://omniroll.integrations.verl.reward"
    cfg.reward.reward_manager.name = "OmnirollImageRewardManager"
    return cfg


def trainer_batch(global_steps: int):
    """As VeRL-Omni's trainer builds it: uid per prompt, n-fold interleaved repeat, then the global row index."""
    from verl import DataProto

    prompts = ["a red cat", 'A Photo of the "OCR" text: Hello-World 42!'][:PROMPTS]
    base = DataProto.from_dict(
        tensors={"input_ids": torch.zeros(PROMPTS, 4, dtype=torch.int64)},
        non_tensors={"raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts], dtype=object),
                     "uid": np.array([f"u{i}" for i in range(PROMPTS)], dtype=object),
                     "data_source": np.array(["test"] * PROMPTS, dtype=object),
                     "reward_model": np.array([{"ground_truth": None}] * PROMPTS, dtype=object),
                     "extra_info": np.array([{"index": i} for i in range(PROMPTS)], dtype=object)},
        meta_info={"global_steps": global_steps, "validate": False})
    batch = base.repeat(repeat_times=N, interleave=True)
    batch.non_tensor_batch["_rollout_seed_global_idx"] = np.arange(len(batch), dtype=np.int64)
    return batch


class StandInWorkerGroup:
    """What LLMServerManager reads of a hybrid worker group on CPU: one rank, no GPU workers."""

    world_size = 1
    workers: list = []


class StandInActor:
    """The actor worker's naive weight sync, as verl's engine_workers does it: resume weights, stream (name, tensor)
    into the hybrid rollout (`get_rollout_class(rollout.name, "async")`), resume the kv cache."""

    def __init__(self, rollout_config, model_config):
        import omniroll.integrations.verl  # noqa: F401 - registration, as external_lib does in a real worker
        from verl.workers.rollout.base import get_rollout_class

        self.rollout = get_rollout_class(rollout_config.name, "async")(rollout_config, model_config, None,
                                                                       replica_rank=0)
        self.weights = {}

    def set_weights(self, weights: dict):
        self.weights = weights

    async def update_weights(self, global_steps=None, mode="naive"):
        await self.rollout.resume(tags=["weights"])
        ack = await self.rollout.update_weights(((n, torch.from_numpy(a)) for n, a in self.weights.items()),
                                                peft_config=None, base_sync_done=True, global_steps=global_steps)
        await self.rollout.resume(tags=["kv_cache"])
        return ack


class StandInActorGroup:
    def __init__(self, actor):
        self.actor = actor

    def update_weights(self, global_steps=None, mode="naive"):
        return [self.actor.update_weights.remote(global_steps=global_steps, mode=mode)]
