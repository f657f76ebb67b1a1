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


def trainer_batch(global_steps: int, uids=None):
    """As VeRL-Omni's trainer builds it: uid per prompt (VeRL-Omni: a fresh uuid4 every step; pass `uids`), n-fold
    interleaved repeat, then the global row index."""
    from verl import DataProto

    prompts = ["a red cat", 'A Photo of the "OCR" text: Hello-World 42!'][:PROMPTS]
    base = DataProto.from_dict(
        tensors={"input_ids": torch.zeros(PROMPTS, 4, dtype=torch.int64)},
        non_tensors={"raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts], dtype=object),
                     "uid": np.array(list(uids or [f"u{i}" for i in range(PROMPTS)]), dtype=object),
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


# ---------------------------------------------------------------------------------------------------------------------
# LoRA weight sync as verl 0.9.1 and VeRL-Omni send it (tests/test_verl_lora.py)

def verl_sender_class():
    """verl 0.9.1's real `BucketedWeightSender`. Its package `verl.workers.rollout.vllm_rollout` imports vllm on
    import, so the module file (torch, zmq and verl.utils.device only) is loaded on its own."""
    import importlib.util

    import verl

    path = os.path.join(os.path.dirname(verl.__file__), "workers/rollout/vllm_rollout/bucketed_weight_transfer.py")
    spec = importlib.util.spec_from_file_location("verl_bucketed_weight_transfer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BucketedWeightSender


class _CpuDevice:
    """The device module of the CPU platform below (what verl's sender calls on it)."""

    @staticmethod
    def synchronize(*_):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def ipc_collect():
        pass

    @staticmethod
    def current_device():
        return 0


def cpu_platform():
    """A verl platform for CPU through verl's own plugin API (`PlatformBase`; install with `set_platform`): verl 0.9.1
    registers only nvidia / huawei / amd and falls back to CUDA, where its sender calls `torch.cuda.synchronize()`."""
    from verl.plugin.platform.platform_base import PlatformBase

    class VerlCpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CpuDevice

        def is_available(self):
            return True

        def current_device(self):
            return 0

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def is_ipc_supported(self):
            return False

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            import contextlib

            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def cudart(self):
            return None

    return VerlCpuPlatform()


class LoRATrainingEngine:
    """The actor's training engine as verl 0.9.1's FSDP engine answers `get_per_tensor_param` for a PEFT model (no
    FSDP wrapping on CPU; verl's own `collect_lora_params` and `replace_lora_wrapper` build the stream): base weights
    (`base_sync_done=False`), the adapter (`True`), or the merged weights with `merge=True` (`peft_config=None`)."""

    def __init__(self, peft_model, merge: bool = False):
        self.module, self.merge = peft_model, merge
        self.is_param_offload_enabled = False

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        import copy

        from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper

        if self.merge:
            merged = copy.deepcopy(self.module).merge_and_unload()
            return iter(list(merged.state_dict().items())), None
        peft_config = self.module.peft_config["default"]
        params = collect_lora_params(self.module, layered_summon=layered_summon, base_sync_done=base_sync_done)
        if not base_sync_done:
            params = {replace_lora_wrapper(k, peft_config): v for k, v in params.items()}
        return iter(list(params.items())), peft_config.to_dict()


class VerlOmniActor:
    """The actor's `update_weights` (naive checkpoint backend) call sequences, replayed from the recorded sources:

    - verl 0.9.1 `workers/engine_workers.py` `update_weights` (naive): resume weights; `get_per_tensor_param(
      base_sync_done=True)`; for an unmerged LoRA `rollout.sleep_level = 1` and, on the first sync with
      `load_format: dummy` (`base_sync_done` False), the base weights first: `rollout.update_weights(base,
      peft_config=cfg, base_sync_done=False)`; then `rollout.update_weights(params, peft_config=cfg,
      base_sync_done=True)`; resume kv_cache; `base_sync_done = True`. Merged LoRA: one update with `peft_config=None`.
    - VeRL-Omni a1139ba's LoRA fast path inside that branch (`use_lora_fast_path = actor_has_lora and not peft_merge
      and base_sync_done`; shared/reference/verl_omni.md section 6, verl_bridge.md rows 23-25): resume weights;
      `future = rollout._execute_method("update_weights_from_ipc", non_block=True, kwargs={peft_config,
      base_sync_done: True, use_shm: rollout.use_shm, zmq_update_id})`; verl's `BucketedWeightSender(zmq_handle,
      bucket_size_mb, use_shm=rollout.use_shm)` streams the adapter; `await future`; resume kv_cache (no
      `clear_kv_cache`, no `set_global_steps`).
    """

    def __init__(self, rollout, engine: LoRATrainingEngine, load_format: str = "dummy", bucket_size_mb: int = 1):
        self.rollout, self.engine = rollout, engine
        self.base_sync_done = "dummy" not in load_format
        self.peft_merge = engine.merge
        self.bucket_size_mb = bucket_size_mb
        self.seq = 0

    async def update_weights(self, global_steps: int):
        await self.rollout.resume(tags=["weights"])
        actor_has_lora = not self.peft_merge and hasattr(self.engine.module, "peft_config")
        if actor_has_lora and not self.peft_merge and self.base_sync_done:
            ack = await self._lora_fast_path(global_steps)
        else:
            acks = []
            per_tensor_param, peft_config = self.engine.get_per_tensor_param(base_sync_done=True)
            if not self.peft_merge and peft_config is not None:
                self.rollout.sleep_level = 1
                if not self.base_sync_done:
                    base, base_peft_config = self.engine.get_per_tensor_param(base_sync_done=False)
                    acks.append(await self.rollout.update_weights(base, peft_config=base_peft_config,
                                                                  base_sync_done=False, global_steps=global_steps))
            acks.append(await self.rollout.update_weights(per_tensor_param, peft_config=peft_config,
                                                          base_sync_done=True, global_steps=global_steps))
            ack = acks
        await self.rollout.resume(tags=["kv_cache"])
        self.base_sync_done = True
        return ack

    async def _lora_fast_path(self, global_steps: int):
        from omniroll.integrations.verl.lora_sync import update_zmq_handle

        per_tensor_param, peft_config = self.engine.get_per_tensor_param(base_sync_done=True)
        self.rollout.sleep_level = 1
        update_id = f"step-{global_steps}-seq-{self.seq}"
        self.seq += 1
        future = await self.rollout._execute_method(
            "update_weights_from_ipc", non_block=True,
            kwargs={"peft_config": peft_config, "base_sync_done": True, "use_shm": self.rollout.use_shm,
                    "zmq_update_id": update_id})
        sender = verl_sender_class()(zmq_handle=update_zmq_handle(self.rollout.zmq_handle, update_id),
                                     bucket_size_mb=self.bucket_size_mb, use_shm=self.rollout.use_shm)
        try:
            await sender.async_send_weights(per_tensor_param)
        finally:
            result = await future  # the receiver's error, if any, after the stream was drained
        return result[0]
