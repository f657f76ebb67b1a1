"""Weight sync: trainers push new weights (full or LoRA) into rollout engines between steps.

Trainer side: :class:`WeightSender` (buckets planned by `buckets`, moved by `transport`). Engine side: the engine's
control calls (`engine/control.py`) run `engine/lifecycle.py`, which checks and applies an update through
`update.prepare_update` (`FullUpdate` with `full`, `LoRAUpdate` with `lora`). (verl's ZMQ stream is received in
`integrations/verl/zmq_receiver.py`.)

Names resolve lazily, so a process that only holds a replica's handle (an agent-loop worker: Ray loads the actor's
class, whose module reads `transport`) does not import PEFT and transformers (about 3 s on the 2-core VM).
"""

import importlib

_WHERE = {
    "Bucket": "buckets", "BucketEntry": "buckets", "ManifestEntry": "buckets", "WeightManifest": "buckets",
    "WeightSyncError": "buckets", "pack_buckets": "buckets", "plan_buckets": "buckets", "unpack_bucket": "buckets",
    "weights_digest": "digest",
    "FullWeightLoader": "full", "peft_base_name": "full",
    "LoRAManager": "lora",
    "LoRABindError": "lora_format", "OmniTensorLoRARequest": "lora_format", "load_lora_dir": "lora_format",
    "lora_config_from_dict": "lora_format", "lora_state_dict": "lora_format", "normalize_lora_keys": "lora_format",
    "peft_config_to_dict": "lora_format",
    "WeightSender": "sender", "named_tensors_for": "sender",
    "FullUpdate": "update", "LoRAUpdate": "update", "check_version": "update", "prepare_update": "update",
    "RayBucketRef": "transport", "ShmChannel": "transport", "ShmStream": "transport", "iter_shm_buckets": "transport",
    "leftover_shm": "transport", "resolve_buckets": "transport",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"omniroll.weights.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'omniroll.weights' has no attribute {name!r}")
