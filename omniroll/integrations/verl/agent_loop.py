"""omniroll's agent loop under verl's `AgentLoopManager` (level B of the bridge: omniroll's seeds, failure reporting
and reward streaming, verl's manager and servers).

- `OmnirollVerlWorker`: verl's worker signature `(config, llm_client, teacher_client, reward_loop_worker_handles)`,
  DataProto in and out. Use it as `AgentLoopManager.agent_loop_workers_class = ray.remote(OmnirollVerlWorker)`, or
  through `OmnirollAgentLoopManager` (`rollout.agent.agent_loop_manager_class`).
- `OmnirollAgentLoopManager`: verl's manager that first fixes each row's group index over the WHOLE batch, so verl's
  equal chunking can never give two samples of one group the same seed.

Seeds: VeRL-Omni's (`seeds.verl_omni_seed`: rollout seed, step, the row's global index), never the per-step uuid4
`uid`, so the same `rollout.seed` gives the same samples in every run, and the same as level A.

Reward extras: the fields a `compute_score` returns besides `score` (verl's `reward_extra_info`) become
`non_tensor_batch` columns named in `meta_info["reward_extra_keys"]` (those every row has), as verl's agent loop does.

Output contract, on top of omniroll's (`agent_loop.output_batch.assemble`): `__num_turns__` int32, per-row
`global_steps` (the trainer's step of the weights that ran the sample's first step, also its `weight_version` here),
`min_global_steps` / `max_global_steps` (the trainer's steps of the oldest / newest weights that ran its recorded steps,
also its `min_weight_version` / `max_weight_version` here; they differ when a `partial` weight update landed while it
ran; `step_weight_versions` holds each recorded step's trainer step), and `meta_info` reduced to what verl's manager
merges across chunks without conflicts: `metrics` (with `tool_calls` = 0) and, when every row was scored,
`reward_extra_keys`.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import ray
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await

from omniroll.agent_loop.batch import DataBatch, to_object_array
from omniroll.reward import RewardResult
from omniroll.agent_loop.manager import AgentLoopManager as OmnirollManager
from omniroll.agent_loop.worker import DiffusionAgentLoopWorker
from omniroll.integrations.verl.config import omniroll_config_from_verl
from omniroll.integrations.verl.seeds import reseed_rows


class VerlClient:
    """omniroll's client interface (`generate(request_id, prompt, sampling_params, seed, ...)`) over verl's
    `LLMServerClient`. An aborted sample (a weight sync on its replica) is re-run with the same seed, so the result
    is the sample it would have been."""

    def __init__(self, llm_client: Any, max_abort_retries: int = 8):
        self.llm_client = llm_client
        self.max_abort_retries = int(max_abort_retries)

    async def generate(self, request_id: str, prompt: str, sampling_params: dict, seed: int,
                       negative_prompt: Optional[str] = None, group_id: Optional[str] = None) -> Any:
        sp = dict(sampling_params, seed=int(seed))
        if sp.get("sde_window_size") is not None and sp.get("sde_window_range") is None:
            sp["sde_window_range"] = (0, max(int(sp["num_inference_steps"]) - 1, 1))  # omniroll's default, explicit
        for attempt in range(self.max_abort_retries + 1):
            out = await self.llm_client.generate(str(request_id), prompt_ids=[], sampling_params=sp, prompt=prompt,
                                                 negative_prompt=negative_prompt)
            if out.stop_reason != "aborted":
                ef = out.extra_fields
                out.num_preempted = int(out.num_preempted or 0) + attempt
                ef["rollout_attempts"] = attempt + 1
                # In verl's world a sample's weight version is the trainer's step of its weights.
                ef["engine_weight_version"], ef["weight_version"] = ef.get("weight_version"), ef["global_steps"]
                for key, steps in (("min_weight_version", "min_global_steps"),
                                   ("max_weight_version", "max_global_steps"),
                                   ("step_weight_versions", "step_global_steps")):
                    if steps in ef:
                        ef[key] = ef[steps]
                return out
        raise RuntimeError(f"request {request_id!r} was aborted {self.max_abort_retries + 1} times")


class OmnirollVerlWorker(DiffusionAgentLoopWorker):
    def __init__(self, config: Any, llm_client: Any, teacher_client: Optional[dict] = None,
                 reward_loop_worker_handles: Optional[list] = None):
        super().__init__(omniroll_config_from_verl(config), VerlClient(llm_client), teacher_client, None)
        if reward_loop_worker_handles:
            from omniroll.integrations.verl.reward import VerlRewardPool

            self.reward_pool = VerlRewardPool(reward_loop_worker_handles)

    def plan(self, batch: DataBatch) -> list[dict]:
        validate = bool(batch.meta_info.get("validate", False))
        n = self.config.val_kwargs.n if validate else self.config.n
        return reseed_rows(super().plan(batch), batch.meta_info, self.config.seed, n)

    async def generate_sequences(self, batch: Any) -> DataProto:  # noqa: D401 - verl's name
        nt = dict(batch.non_tensor_batch)
        if "_group_index" not in nt and "_rollout_seed_global_idx" not in nt:
            raise ValueError("OmnirollVerlWorker under verl's AgentLoopManager gets one chunk of the batch and cannot "
                             "tell where its rows sit in their groups: the batch needs _rollout_seed_global_idx "
                             "(VeRL-Omni's trainer sets it) or _group_index; or use "
                             "rollout.agent.agent_loop_manager_class="
                             "omniroll.integrations.verl.OmnirollAgentLoopManager")
        td = batch.batch if batch.batch is not None and len(batch.batch.keys()) else None
        out = await super().generate_sequences(DataBatch(td, nt, dict(batch.meta_info), batch_size=len(batch)))
        return to_dataproto(out)


def to_dataproto(out: DataBatch) -> DataProto:
    nt = dict(out.non_tensor_batch)
    nt["__num_turns__"] = np.asarray([int(t) for t in nt["__num_turns__"]], dtype=np.int32)
    def column(key: str, fallback: str = "weight_version") -> np.ndarray:
        vals = nt.get(key, nt.get(fallback, [None] * len(out)))
        return to_object_array([int(v) if v is not None else -1 for v in vals])

    nt["global_steps"] = column("weight_version")
    nt["min_global_steps"] = column("min_weight_version")
    nt["max_global_steps"] = column("max_weight_version")
    meta = out.meta_info
    metrics = [{**m, "tool_calls": 0.0} for m in meta.get("metrics", [])]
    new_meta: dict[str, Any] = {"metrics": metrics}
    if "rm_scores" in out.batch.keys():
        extra_keys = _reward_extras(nt)
        new_meta["reward_extra_keys"] = sorted(set(meta.get("reward_extra_keys") or []) | set(extra_keys))
    return DataProto(batch=out.batch, non_tensor_batch=nt, meta_info=new_meta)


# what omniroll itself records in each row's `reward_extra_info` (postprocess); the other keys are the scorer's extras
_REWARD_BOOKKEEPING = frozenset(f for f in RewardResult.__dataclass_fields__ if f not in ("sample_id", "extra_info"))


def _reward_extras(nt: dict) -> list[str]:
    """verl's reward extras: the keys (besides omniroll's own) every row's `reward_extra_info` has, each made a
    column of `nt` (in place). A key that would overwrite another column is an error naming it."""
    infos = [dict(i or {}) for i in nt.get("reward_extra_info", [])]
    if not infos:
        return []
    keys = sorted(set.intersection(*[set(i) - _REWARD_BOOKKEEPING for i in infos]))
    for k in keys:
        if k in nt:
            raise ValueError(f"reward extra field {k!r} (returned by compute_score) collides with the batch column of "
                             f"the same name; rename it in compute_score")
        nt[k] = to_object_array([i[k] for i in infos])
    return keys


class OmnirollAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager with omniroll's worker; `create(config, llm_client, teacher_client=None,
    reward_loop_worker_handles=None)` as verl's trainer calls it."""

    agent_loop_workers_class = ray.remote(OmnirollVerlWorker)

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        nt = prompts.non_tensor_batch
        if "_rollout_seed_global_idx" not in nt:  # what VeRL-Omni's trainer sets; seeds derive from it
            if "_group_index" not in nt:
                whole = OmnirollManager.prepare(DataBatch(None, dict(nt), {}, batch_size=len(prompts)))
                nt["uid"] = whole.non_tensor_batch["uid"]
                nt["_group_index"] = whole.non_tensor_batch["_group_index"]
            nt["_rollout_seed_global_idx"] = np.arange(len(prompts), dtype=np.int64)
        return await super().generate_sequences(prompts)
