"""Weight sync: trainers push new weights (full or LoRA) into rollout engines between steps.

Trainer side: :class:`WeightSender` (buckets planned by `buckets`, moved by `transport`). Engine side: the engine's
control calls (`engine/control.py`) run `engine/lifecycle.py`, which checks and applies an update through
`update.prepare_update` (`FullUpdate` with `full`, `LoRAUpdate` with `lora`). (verl's ZMQ stream is received in
`integrations/verl/zmq_receiver.py`.)
"""

from .buckets import (
    Bucket,
    BucketEntry,
    ManifestEntry,
    WeightManifest,
    WeightSyncError,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
)
from .digest import weights_digest
from .full import FullWeightLoader, peft_base_name
from .lora import LoRAManager
from .lora_format import (
    LoRABindError,
    OmniTensorLoRARequest,
    load_lora_dir,
    lora_config_from_dict,
    lora_state_dict,
    normalize_lora_keys,
    peft_config_to_dict,
)
from .sender import WeightSender, named_tensors_for
from .update import FullUpdate, LoRAUpdate, check_version, prepare_update
from .transport import RayBucketRef, ShmChannel, ShmStream, iter_shm_buckets, leftover_shm, resolve_buckets

__all__ = [
    "Bucket", "BucketEntry", "ManifestEntry", "WeightManifest", "WeightSyncError", "pack_buckets", "plan_buckets",
    "unpack_bucket", "FullWeightLoader", "peft_base_name", "LoRABindError", "LoRAManager", "OmniTensorLoRARequest",
    "load_lora_dir", "lora_config_from_dict", "lora_state_dict", "normalize_lora_keys", "peft_config_to_dict",
    "WeightSender", "named_tensors_for", "RayBucketRef", "ShmChannel",
    "ShmStream", "iter_shm_buckets", "leftover_shm", "resolve_buckets", "FullUpdate", "LoRAUpdate", "check_version",
    "prepare_update", "weights_digest",
]
