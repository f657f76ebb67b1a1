"""`OmnirollServer`: one omniroll engine behind the RPC surface verl's and VeRL-Omni's callers use on a vLLM-Omni
server actor (`server.generate.remote(...)`, the lifecycle calls of `RolloutReplica` / `CheckpointEngineManager`).

Calls with no diffusion meaning are documented no-ops: `release_kv_cache` / `resume_kv_cache` (a diffusion engine
keeps no KV cache; activations live for one step), `start_profile` / `stop_profile`. `clear_kv_cache` clears the
prompt-encoding cache.

Weights arrive two ways, both ending in one transactional engine update under verl's LoRA convention
(`lora_sync.engine_update`): `load_weight_buckets` (verl's naive `update_weights`, see `OmnirollServerAdapter`) and
`update_weights_from_ipc` (VeRL-Omni's LoRA fast path: verl's bucketed ZMQ stream over shared memory).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Optional

import torch
from pydantic import ValidationError

from omniroll.engine.output import DiffusionOutput
from omniroll.engine.params import GenerationRequest, SamplingParams
from omniroll.integrations.verl.lora_sync import current_job_id, engine_update, update_zmq_handle, zmq_handle_for
from omniroll.integrations.verl.sampling import fresh_seed, map_sampling_params
from omniroll.models.base import is_sequence_embedding
from omniroll.rollout.wire import output_from_wire, output_to_wire

BUCKET_BYTES = 256 << 20  # how a received ZMQ stream is handed to the engine (by reference: no copy)


class VerlDiffusionOutput(DiffusionOutput):
    """A DiffusionOutput with the field names VeRL-Omni's agent loop reads, whose tensors cross Ray as numpy."""

    def __reduce__(self):
        return (_from_wire, (output_to_wire(self),))


def _from_wire(wire: dict) -> VerlDiffusionOutput:
    return VerlDiffusionOutput(**output_from_wire(wire).model_dump())


def to_verl_output(out: DiffusionOutput, global_steps: int,
                   steps_of: Optional[Callable[[int], int]] = None) -> VerlDiffusionOutput:
    """Add VeRL-Omni's names: `global_steps` (the trainer's step of the weights the sample was generated with), its
    `min_global_steps` / `max_global_steps` and `step_global_steps` (the sample's `min_weight_version`,
    `max_weight_version` and `step_weight_versions` through `steps_of`, the engine version -> trainer step map;
    default: the versions as they are), `*_mask` for the prompt embeddings (all ones: omniroll's embeddings carry no
    padding), `latents_clean` for output_type "both"."""
    ef = dict(out.extra_fields)
    ef["global_steps"] = int(global_steps)
    steps_of = steps_of or int
    if "min_weight_version" in ef:
        ef["min_global_steps"] = int(steps_of(int(ef["min_weight_version"])))
        ef["max_global_steps"] = int(steps_of(int(ef["max_weight_version"])))
        ef["step_global_steps"] = [int(steps_of(int(v))) for v in ef.get("step_weight_versions", [])]
    for key in [k for k, v in ef.items() if is_sequence_embedding(k) and isinstance(v, torch.Tensor)]:
        ef[f"{key}_mask"] = torch.ones(ef[key].shape[0], dtype=torch.int64)
    if "latents" in ef:
        ef["latents_clean"] = ef["latents"]
    return VerlDiffusionOutput(diffusion_output=out.diffusion_output, log_probs=out.log_probs,
                               stop_reason=out.stop_reason, num_preempted=out.num_preempted, extra_fields=ef)


class OmnirollServer:
    """Run as `ray.remote(OmnirollServer).options(max_concurrency=...)` (see `OmnirollReplica.launch_servers`)."""

    def __init__(self, model_path: str, replica_rank: int = 0, engine_kwargs: Optional[dict] = None,
                 sleep_level: int = 1):
        from omniroll.engine.engine import DiffusionEngine
        from omniroll.rollout.replica import resolve_engine_kwargs

        self.replica_rank = int(replica_rank)
        self.sleep_level = int(sleep_level)
        self.engine = DiffusionEngine.from_pretrained(model_path, **resolve_engine_kwargs(engine_kwargs))
        self._gate = asyncio.Event()
        self._gate.set()
        self._reject = False
        self._global_steps: dict[int, int] = {}  # engine weight version -> the trainer's step (set_global_steps)

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Optional[dict] = None, negative_prompt_ids: Optional[list[int]] = None,
                       prompt_mask: Any = None, extra_prompt_ids: Optional[dict] = None,
                       negative_extra_prompt_ids: Optional[dict] = None, priority: int = 0,
                       prompt: Optional[str] = None, negative_prompt: Optional[str] = None) -> VerlDiffusionOutput:
        """vLLM-Omni's `generate`. The prompt is `extra_prompt_ids` (per-encoder token ids, SD3: `{"clip", "t5"}`,
        what VeRL-Omni's agent loop sends with `extra_tokenizers` set) or the text `prompt` (omniroll's verl worker).
        `prompt_ids` alone (the chat-template tokens of a language tokenizer) cannot be encoded by a diffusion
        model's own text encoders and is refused. `prompt_mask` and `priority` are accepted and unused (the engine
        schedules fairly across requests). Returns stop_reason "aborted" (and no pixels) on abort."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("omniroll serves text-to-image: image_data / video_data / audio_data must be None")
        fields, seed, _ = map_sampling_params(dict(sampling_params or {}))
        if negative_prompt_ids and not negative_extra_prompt_ids and negative_prompt is None:
            raise ValueError("negative_prompt_ids alone (a language tokenizer's ids) cannot be encoded: send "
                             "negative_extra_prompt_ids (per-encoder ids) or negative_prompt (text)")
        prompt_kw = self._prompt_fields(prompt, negative_prompt, extra_prompt_ids, negative_extra_prompt_ids)
        try:
            request = GenerationRequest(request_id=str(request_id), sampling_params=SamplingParams(**fields),
                                        seed=fresh_seed() if seed is None else seed, **prompt_kw)
        except ValidationError as e:  # re-raised as ValueError: pydantic errors do not pickle reliably
            raise ValueError(f"request {request_id!r}: " + "; ".join(
                f"{'.'.join(map(str, err['loc'])) or '<request>'}: {err['msg']}" for err in e.errors())) from None
        if not self._gate.is_set():
            if self._reject:
                raise RuntimeError(f"request {request_id!r} rejected: generation is paused (abort_all_requests)")
            await self._gate.wait()
        out = await self.engine.generate_async(request)
        out.extra_fields.setdefault("replica_rank", self.replica_rank)
        version = int(out.extra_fields.get("weight_version", 0))
        return to_verl_output(out, self._global_steps.get(version, version),
                              lambda v: self._global_steps.get(v, v))

    @staticmethod
    def _prompt_fields(prompt, negative_prompt, extra_ids, negative_extra_ids) -> dict:
        if prompt is None and not extra_ids:
            raise ValueError("omniroll needs the prompt as per-encoder token ids (extra_prompt_ids, e.g. SD3 "
                             "{'clip': [...], 't5': [...]}: set VeRL-Omni's actor_rollout_ref.model.extra_tokenizers) "
                             "or as text (prompt=); prompt_ids alone are a language tokenizer's ids")
        kw: dict[str, Any] = {}
        if prompt is not None:
            kw["prompt"] = prompt
        else:
            kw["prompt_token_ids"] = {k: [int(i) for i in v] for k, v in dict(extra_ids).items()}
        if negative_prompt is not None:
            kw["negative_prompt"] = negative_prompt
        elif negative_extra_ids:
            kw["negative_prompt_token_ids"] = {k: [int(i) for i in v] for k, v in dict(negative_extra_ids).items()}
        return kw

    async def abort_request(self, request_id: str) -> dict:
        return {"aborted": bool(await asyncio.to_thread(self.engine.abort, str(request_id)))}

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        """Stop admitting (new calls wait for `resume_generation`, or fail with `reject_request=True`), then abort
        every request in the engine; their `generate` calls return stop_reason "aborted"."""
        self._reject = bool(reject_request)
        self._gate.clear()
        return {"aborted": await asyncio.to_thread(self.engine.abort_all)}

    async def resume_generation(self) -> None:
        self._reject = False
        self._gate.set()

    async def wait_for_requests_to_drain(self, poll_s: float = 0.05) -> None:
        while True:
            s = self.engine.stats()
            if not s["running"] and not s["waiting"]:
                return
            await asyncio.sleep(poll_s)

    # ------------------------------------------------------------------ memory and weights
    async def sleep(self, level: Optional[int] = None) -> dict:
        """Free the device (level 1: weights to host memory, the default; level 2: drop the denoiser)."""
        return await asyncio.to_thread(self.engine.sleep, level or self.sleep_level)

    async def wake_up(self, tags: Optional[list[str]] = None) -> dict:
        """Bring the weights back (`tags` "weights" / "kv_cache": one device state here, so any tag wakes it)."""
        if not self.engine.asleep_level:
            return {"awake": True}
        return await asyncio.to_thread(self.engine.wake_up)

    async def clear_kv_cache(self) -> None:
        """The diffusion counterpart: drop cached prompt encodings."""
        await asyncio.to_thread(self.engine.call_between_steps, self.engine.prompt_cache.clear)

    async def release_kv_cache(self) -> None:
        """No-op: a diffusion engine holds no KV cache."""

    async def resume_kv_cache(self) -> None:
        """No-op: a diffusion engine holds no KV cache."""

    async def start_profile(self, **kwargs) -> None:
        """No-op (use torch.profiler around the engine directly)."""

    async def stop_profile(self) -> None:
        """No-op."""

    async def set_global_steps(self, global_steps: int) -> None:
        """Tag the current weights with the trainer's step: samples generated with them report it as
        `global_steps`."""
        self._global_steps[self.engine.weight_version] = int(global_steps)

    async def load_weight_buckets(self, peft_config: Optional[dict] = None, base_sync_done: bool = False, *,
                                  manifest, buckets, global_steps: Optional[int] = None) -> dict:
        """omniroll's transactional weight update: the engine checks every name, shape and dtype before the first
        byte arrives and lands the update between two denoising steps, so a bad stream changes nothing. The engine's
        own version counts updates (it only rises; verl may re-sync the same step); `global_steps` tags the new
        weights."""
        return await self._apply(peft_config, base_sync_done, manifest, buckets, global_steps)

    async def update_weights_from_ipc(self, peft_config: Optional[dict] = None, base_sync_done: bool = False,
                                      use_shm: bool = False, zmq_update_id: Optional[str] = None,
                                      global_steps: Optional[int] = None, timeout_s: float = 600.0,
                                      **unknown) -> dict:
        """The receiving end of VeRL-Omni's LoRA fast path (and of any verl `BucketedWeightSender` stream): read the
        stream from this replica's socket (`zmq_handle_for`, per update with `zmq_update_id`) into host memory, then
        land it as one transaction (`load_weight_buckets`' guarantees). Shared memory only (`use_shm=True`); a stream
        is always drained before an error is raised, so the sender never hangs. Without `global_steps` (VeRL-Omni's
        fast path sends none) the new weights keep the trainer step of the previous ones until `set_global_steps`."""
        from omniroll.weights.buckets import WeightManifest, pack_buckets
        from omniroll.integrations.verl.zmq_receiver import receive_zmq_stream

        handle = update_zmq_handle(zmq_handle_for(current_job_id(), self.replica_rank), zmq_update_id)
        named = await asyncio.to_thread(receive_zmq_stream, handle, bool(use_shm), timeout_s)
        if unknown:  # refused only now: refusing before the stream was drained would leave the sender waiting forever
            raise TypeError(f"update_weights_from_ipc: unknown keyword(s) {sorted(unknown)}; the stream was drained "
                            f"and nothing applied")
        if not named:
            raise ValueError("update_weights_from_ipc: the weight stream was empty; nothing applied")
        manifest = WeightManifest.from_named_tensors(named)
        buckets = pack_buckets(named, BUCKET_BYTES, by_reference=True)  # the engine reads them once, lazily
        return await self._apply(peft_config, base_sync_done, manifest, buckets, global_steps)

    async def _apply(self, peft_config, base_sync_done, manifest, buckets, global_steps) -> dict:
        engine_peft, name_map, kind = engine_update(peft_config, base_sync_done)
        previous = self.engine.weight_version
        version = previous + 1
        ack = await asyncio.to_thread(self.engine.update_weights_from_ipc, engine_peft, bool(base_sync_done), False,
                                      manifest=manifest, buckets=buckets, version=version, name_map=name_map)
        self._global_steps[version] = (int(global_steps) if global_steps is not None
                                       else self._global_steps.get(previous, previous))
        return {**ack, "update": kind, "replica_rank": self.replica_rank,
                "global_steps": self._global_steps[version]}

    async def collective_rpc(self, method: str, timeout: Optional[float] = None, args: tuple = (),
                             kwargs: Optional[dict] = None) -> list:
        """vLLM's worker RPC, for the calls that mean something here ("sleep", "wake_up", "update_weights_from_ipc");
        one worker, one result."""
        calls = {"sleep": self.sleep, "wake_up": self.wake_up,
                 "update_weights_from_ipc": self.update_weights_from_ipc}
        if method not in calls:
            raise NotImplementedError(f"collective_rpc({method!r}) is not supported by omniroll; "
                                      f"supported: {sorted(calls)}")
        return [await asyncio.wait_for(calls[method](*args, **(kwargs or {})), timeout)]

    def health(self) -> dict:
        version = int(self.engine.weight_version)
        return {"ok": True, "replica_rank": self.replica_rank, "pid": os.getpid(), "weight_version": version,
                "global_steps": self._global_steps.get(version, version)}

    def stats(self) -> dict:
        return self.engine.stats()
