"""How verl and VeRL-Omni send weights, and what each update means to omniroll's engine.

verl's convention (its vLLM rollout worker, `update_weights_from_ipc`): an update is a LoRA adapter only when
`peft_config` is set AND `base_sync_done` is true. Otherwise it is full weights:
- `peft_config` set, `base_sync_done=False`: the first sync of a LoRA run (VeRL-Omni with `load_format: dummy`), the
  BASE weights of the PEFT model, some named `x.base_layer.weight` (verl's `replace_lora_wrapper`). They land as a
  full update, names mapped to the plain module (`peft_base_name`); the adapter follows in a second update;
- `peft_config=None`: full weights (`lora.merge: true` sends the merged weights this way).
Every update, of either kind, is one omniroll transaction (see `omniroll.weights.update`).

VeRL-Omni's LoRA fast path (its actor's naive branch, when `actor_has_lora and not peft_merge and base_sync_done`)
reads `zmq_handle`, `use_shm` and `_execute_method` on the rollout adapter, starts the receiver with
`_execute_method("update_weights_from_ipc", non_block=True, kwargs={peft_config, base_sync_done, use_shm,
zmq_update_id})`, then streams the adapter with verl's `BucketedWeightSender` to the ZMQ socket `zmq_handle` (made
per update by `update_zmq_handle` when an update id is given). The server's receiver
(`omniroll.integrations.verl.zmq_receiver`) reads the stream into host memory, then lands it as one transaction.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from omniroll.weights.full import peft_base_name
from omniroll.weights.lora_format import peft_config_to_dict

def is_lora_update(peft_config: Any, base_sync_done: bool) -> bool:
    """verl's rule: an adapter update only when `peft_config` is set and the base weights were synced."""
    return bool(peft_config) and bool(base_sync_done)


def engine_update(peft_config: Any, base_sync_done: bool) -> tuple[Optional[dict], Optional[Callable[[str], str]],
                                                                    str]:
    """What the engine is given for one verl update: (peft_config for the engine, name_map, kind). kind is "lora",
    "base" (a LoRA run's base weights: full, names mapped to the plain module) or "full"."""
    if is_lora_update(peft_config, base_sync_done):
        return peft_dict(peft_config), None, "lora"
    if peft_config:
        return None, peft_base_name, "base"
    return None, None, "full"


def peft_dict(peft_config: Any) -> Optional[dict]:
    if peft_config is None or isinstance(peft_config, dict):
        return peft_config
    return peft_config_to_dict(peft_config)


def zmq_handle_for(job_id: str, replica_rank: int, local_rank: int = 0) -> str:
    """The socket between a trainer rank and its colocated rollout worker: verl's vLLM rollout's name (one omniroll
    replica is one device, local rank 0), in this user's private socket directory (mode 0700) instead of /tmp, since
    the stream is pickled (`zmq_receiver.private_socket_dir`). The sender binds the handle the adapter gives it."""
    from omniroll.integrations.verl.zmq_receiver import private_socket_dir

    return (f"ipc://{private_socket_dir()}/rl-colocate-zmq-{job_id}-replica-{int(replica_rank)}-rank-"
            f"{int(local_rank)}.sock")


def update_zmq_handle(zmq_handle: str, update_id: Optional[str]) -> str:
    """VeRL-Omni's per-update socket (each update its own path, so a retry never meets a stale socket): the update id
    is inserted before `.sock` of an ipc handle; other handles (tcp) and `update_id=None` are unchanged."""
    if update_id is None or update_id == "" or not zmq_handle.startswith("ipc://"):
        return zmq_handle
    stem = zmq_handle[:-len(".sock")] if zmq_handle.endswith(".sock") else zmq_handle
    return f"{stem}-update-{update_id}.sock"


def current_job_id() -> str:
    import ray

    return os.environ.get("VERL_RAY_JOB_ID") or ray.get_runtime_context().get_job_id()
