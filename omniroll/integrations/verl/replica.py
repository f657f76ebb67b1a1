"""verl's two rollout classes for `rollout.name=omniroll`: `OmnirollReplica` (a verl `RolloutReplica`: launches one
`OmnirollServer` actor per replica) and `OmnirollServerAdapter` (a verl `BaseRollout`: what the actor worker calls to
wake, free and update the rollout's weights).

One omniroll replica is one device: `tensor_model_parallel_size`, `data_parallel_size` and
`pipeline_model_parallel_size` must be 1. Server actors are named `omniroll_server_{replica_rank}_0{suffix}`; each
replica's `server_address` is unique (verl's load balancer keys servers by address).
"""

from __future__ import annotations

import os
from typing import Any, Generator, Optional

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from omniroll.integrations.verl.config import engine_kwargs_from_verl
from omniroll.integrations.verl.lora_sync import current_job_id, peft_dict, zmq_handle_for
from omniroll.integrations.verl.server import OmnirollServer
from omniroll.ray_nodes import this_node_id

SERVER_PREFIX = "omniroll_server_"


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{SERVER_PREFIX}{replica_rank}_0{suffix}"


def _check_one_device(config: Any) -> None:
    sizes = {k: int(getattr(config, k, 1) or 1) for k in
             ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")}
    bad = {k: v for k, v in sizes.items() if v != 1}
    if bad:
        settings = ", ".join(f"rollout.{k}=1" for k in bad)
        raise ValueError(f"rollout.name=omniroll: one replica is one device; set {settings} (got {bad})")


class OmnirollReplica(RolloutReplica):
    """Hybrid (on the actor worker's device), colocated and standalone launch all end in `launch_servers`; the
    standalone and colocated paths get their GPU bundles from verl, so they need GPUs."""

    async def launch_servers(self):
        _check_one_device(self.config)
        env_vars: dict[str, str] = {}
        options: dict[str, Any] = {}
        if self.workers:  # the server goes where the replica's worker is, on that worker's device
            worker = self.workers[0]
            node_id, devices = await worker.__ray_call__.remote(_node_and_devices)
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False)
            if devices:
                env_vars.update(CUDA_VISIBLE_DEVICES=",".join(devices), RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1")
        name = server_name(self.replica_rank, self.name_suffix)
        model_path = str(self.model_config.get("local_path") or self.model_config.path)
        cls = ray.remote(OmnirollServer).options(
            name=name, max_concurrency=self.max_concurrency, num_cpus=0,
            runtime_env={"env_vars": env_vars} if env_vars else None, **options)
        server = cls.remote(model_path, self.replica_rank, engine_kwargs_from_verl(self.config, bool(env_vars)))
        await server.health.remote()  # a bad model path or an out-of-memory surfaces here, not at the first sample
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{name}@{ray.util.get_node_ip_address()}"

    def rollout_worker_use_gpu(self) -> bool:
        return torch.cuda.is_available()


def _node_and_devices(_self) -> tuple[str, list[str]]:
    ids = ray.get_runtime_context().get_accelerator_ids()
    return this_node_id(), [str(i) for i in ids.get("GPU", [])]


class OmnirollServerAdapter(BaseRollout):
    """The actor worker's handle on its replica's server (verl's `get_rollout_class("omniroll", "async")`).

    `update_weights` takes verl's stream of `(name, tensor)` (no manifest up front): it collects the stream on the
    host, then hands the server one complete, named update, which the engine validates in full before the first byte
    lands and swaps between two denoising steps, so a bad or partial stream never leaves mixed weights. The price is
    one host copy of what is sent (the LoRA adapter, or the full denoiser). verl's LoRA convention applies
    (`lora_sync.engine_update`): `peft_config` with `base_sync_done=False` is the base weights, a full update.

    VeRL-Omni's LoRA fast path uses `zmq_handle`, `use_shm` and `_execute_method` (as on verl's vLLM
    `ServerAdapter`): it starts the server's receiver with `_execute_method("update_weights_from_ipc", non_block=True,
    kwargs=...)` and streams the adapter with verl's `BucketedWeightSender` to `zmq_handle`. `use_shm` is always True:
    omniroll's receiver reads shared memory (on a GPU the sender copies each bucket to host memory; CUDA-IPC handles
    are not read, see `omniroll.integrations.verl.zmq_receiver`).
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1, **kwargs):
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config  # kept as given: omniroll needs only the checkpoint path
        self.device_mesh = device_mesh
        _check_one_device(self.config)
        self.replica_rank = int(os.environ.get("RANK", 0)) if replica_rank == -1 else int(replica_rank)
        self.is_leader_rank = True  # one device per replica: every rank leads its replica
        self.sleep_level = 1
        self.bucket_bytes = 256 << 20
        self.use_shm = True
        self.zmq_handle = zmq_handle_for(current_job_id(), self.replica_rank)
        self._server = None

    @property
    def server(self):
        if self._server is None:  # the server is launched after the hybrid engine: look it up lazily
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def _execute_method(self, method: str, non_block: bool = False, timeout: Optional[float] = None,
                              args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """verl's vLLM `ServerAdapter._execute_method`: the server's `collective_rpc(method, ...)`; with `non_block`
        the Ray ObjectRef is returned at once (await it for the result)."""
        future = self.server.collective_rpc.remote(method, timeout=timeout, args=tuple(args), kwargs=dict(kwargs or {}))
        return future if non_block else await future

    async def resume(self, tags: list[str]):
        await self.server.wake_up.remote(tags=list(tags))

    async def release(self):
        await self.server.sleep.remote()

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", peft_config: Optional[Any] = None,
                             base_sync_done: bool = False, global_steps: Optional[int] = None, **kwargs) -> dict:
        from omniroll.weights.buckets import WeightManifest, pack_buckets
        from omniroll.weights.transport import RayBucketRef

        if wire_format != "named_tensors":
            raise NotImplementedError(f"omniroll takes wire_format='named_tensors', got {wire_format!r}")
        named = [(str(n), t.detach().to("cpu").contiguous()) for n, t in weights]
        if not named:
            raise ValueError("update_weights: the weight stream was empty")
        manifest = WeightManifest.from_named_tensors(named)
        refs = [RayBucketRef(ray.put(b.buffer), b.entries, b.index) for b in pack_buckets(named, self.bucket_bytes)]
        del named
        ack = await self.server.load_weight_buckets.remote(
            peft_config=peft_dict(peft_config), base_sync_done=bool(base_sync_done), manifest=manifest,
            buckets=refs, global_steps=global_steps)
        return ack
