"""`rollout.name=omniroll` for verl / VeRL-Omni (install `omniroll[verl]`).

Importing this module registers omniroll with verl, in whichever process imports it:
- `RolloutReplicaRegistry` "omniroll" -> `OmnirollReplica` (the driver's `LLMServerManager`);
- verl's async rollout registry ("omniroll", "async") -> `OmnirollServerAdapter` (each actor worker's hybrid rollout);
- verl's reward-manager registry "omniroll_image" -> `OmnirollImageRewardManager` (each reward worker).
A VeRL-Omni config makes every process import it with `actor_rollout_ref.model.external_lib=omniroll.integrations.verl`
(see docs/verl.md).
"""

from __future__ import annotations

from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

from omniroll.integrations.verl.agent_loop import OmnirollAgentLoopManager, OmnirollVerlWorker, VerlClient
from omniroll.integrations.verl.config import omniroll_config_from_verl
from omniroll.integrations.verl.replica import OmnirollReplica, OmnirollServerAdapter, server_name
from omniroll.integrations.verl.reward import OmnirollImageRewardManager, VerlRewardPool
from omniroll.integrations.verl.sampling import map_sampling_params
from omniroll.integrations.verl.seeds import verl_omni_seed
from omniroll.integrations.verl.server import OmnirollServer, VerlDiffusionOutput

ROLLOUT_NAME = "omniroll"


def register() -> None:
    """Register omniroll in verl's replica and async-rollout registries (idempotent; done on import)."""
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: OmnirollReplica)
    adapter = f"{OmnirollServerAdapter.__module__}.{OmnirollServerAdapter.__name__}"
    _rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = adapter


register()

__all__ = ["OmnirollAgentLoopManager", "OmnirollImageRewardManager", "OmnirollReplica", "OmnirollServer",
           "OmnirollServerAdapter", "OmnirollVerlWorker", "VerlClient", "VerlDiffusionOutput", "VerlRewardPool",
           "map_sampling_params", "omniroll_config_from_verl", "register", "server_name", "verl_omni_seed"]
