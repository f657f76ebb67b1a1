"""`RolloutReplica`: one DiffusionEngine behind a Ray actor.

Used as `ray.remote(RolloutReplica).options(max_concurrency=1000, num_cpus=..., num_gpus=...)` (see
`create_replicas`). Every generate is an async method, so one actor serves many requests at once and the engine
batches them; results leave the actor in wire format (rollout/wire.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any, Callable, Optional

import torch
from pydantic import ValidationError

from omniroll.engine.config import torch_dtype
from omniroll.engine.errors import RequestError
from omniroll.engine.memory import device_identity, peak_bytes
from omniroll.engine.params import GenerationRequest
from omniroll.errors import format_validation_error
from omniroll.library_warnings import silence_library_warnings
from omniroll.ray_nodes import kill_actors as kill_replicas, this_node
from omniroll.rollout.wire import output_to_wire
from omniroll.weights.transport import transport_of


def resolve_engine_kwargs(kwargs: Optional[dict]) -> dict:
    """A config's engine kwargs (dtype as its name) -> `DiffusionEngine.from_pretrained`'s (dtype as torch's)."""
    kw = dict(kwargs or {})
    dtype = kw.get("dtype")
    if isinstance(dtype, str):
        try:
            kw["dtype"] = torch_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"engine_kwargs.{e}") from None
    return kw


class RolloutReplica:
    """Hosts one `DiffusionEngine`. Construct through Ray (`create_replicas`) or directly in-process for tests."""

    def __init__(self, model_path: str, replica_index: int = 0, engine_kwargs: Optional[dict] = None):
        from omniroll.engine.engine import DiffusionEngine

        silence_library_warnings()  # this actor's process: third-party warnings its user cannot act on
        self.model_path = model_path
        self.replica_index = int(replica_index)
        self.engine = DiffusionEngine.from_pretrained(model_path, **resolve_engine_kwargs(engine_kwargs))
        self._in_flight = 0
        self._served = 0
        self._failed = 0
        self._aborted = 0
        self._started_at = time.time()
        self._node_id, self._node_address = this_node()

    async def generate(self, request: dict | GenerationRequest) -> dict:
        """Generate one sample; returns `output_to_wire(DiffusionOutput)`. A request the engine will not serve (bad
        field, unencodable or too long prompt, duplicate id) raises `RequestError` (a ValueError) naming the request
        and the reason; it never disturbs other requests."""
        if not isinstance(request, GenerationRequest):
            try:
                request = GenerationRequest.model_validate(request)
            except ValidationError as e:  # re-raised as RequestError: pydantic errors do not pickle reliably
                rid = request.get("request_id") if isinstance(request, dict) else None
                raise RequestError(str(rid), f"bad GenerationRequest: {_describe(e)}") from None
        self._in_flight += 1
        try:
            out = await self.engine.generate_async(request)
        except BaseException:
            self._failed += 1
            raise
        finally:
            self._in_flight -= 1
        if out.stop_reason == "aborted":
            self._aborted += 1
        else:
            self._served += 1
        out.extra_fields.setdefault("replica_index", self.replica_index)
        out.extra_fields.setdefault("replica_node_id", self._node_id)
        return output_to_wire(out)

    async def abort(self, request_id: str, timeout_s: float = 60.0) -> bool:
        """Abort a running or queued request; its generate returns with stop_reason="aborted". Returns once the
        request has stopped (acknowledged), without blocking the actor's other calls."""
        return bool(await asyncio.to_thread(self.engine.abort, request_id, timeout_s))

    async def abort_all(self, timeout_s: float = 60.0) -> list[str]:
        """Abort every running or queued request (acknowledged); returns their ids."""
        return await asyncio.to_thread(self.engine.abort_all, timeout_s)

    def health(self) -> dict:
        closed = self.engine.stats()["shut_down"]
        return {
            "ok": not closed,
            "state": "shut down" if closed else "serving",
            "replica_index": self.replica_index,
            "weight_version": int(self.engine.weight_version),
            "pid": os.getpid(),
            "torch_threads": _torch_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "host": socket.gethostname(),
            "node_id": self._node_id,
            "node_address": self._node_address,
            "uptime_s": time.time() - self._started_at,
        }

    def memory(self) -> dict:
        """The engine's device (`device_identity`: the GPU's UUID) and the peak bytes this replica allocated on it
        since the last call (None on the CPU); a new peak starts."""
        device = self.engine.config.device
        return {"device": device_identity(device), "peak_bytes": peak_bytes(device)}

    async def sample_identity(self, timeout_s: float = 60.0) -> dict:
        """`DiffusionEngine.sample_identity`: what this replica's pixels depend on besides the request."""
        return await asyncio.to_thread(self.engine.sample_identity, timeout_s)

    def node_id(self) -> Optional[str]:
        """The Ray node this replica lives on (None outside Ray): the weight sender picks its transport from it."""
        return self._node_id

    def stats(self) -> dict:
        s: dict[str, Any] = dict(self.engine.stats())
        return {
            "replica_index": self.replica_index,
            "in_flight": self._in_flight,
            "queued": int(s.get("waiting", 0)),
            "running": int(s.get("running", 0)),
            "served": self._served,
            "failed": self._failed,
            "aborted": self._aborted,
            "weight_version": int(s.get("weight_version", self.engine.weight_version)),
            "asleep_level": int(s.get("asleep_level", 0)),
            "lora": s.get("lora"),
            "admission_paused": bool(s.get("admission_paused", False)),  # an update draining samples in flight
            "steps": int(s.get("steps", 0)),  # denoiser forwards run, and the rows they ran (a CFG sample is 2)
            "forward_rows": int(round(float(s.get("mean_rows_per_step", 0.0)) * int(s.get("steps", 0)))),
        }

    def shutdown(self) -> None:
        """Stop the engine: pending requests fail, and every later call raises EngineShutdownError at once."""
        self.engine.shutdown()

    # ------------------------------------------------------------------ weight sync and memory
    # Each runs on a worker thread: the engine checks, receives, then pauses, drains, aborts (acknowledged) and swaps
    # on its own thread, while this actor's event loop keeps answering generate / stats calls. Each has a finite
    # timeout (TimeoutError naming the call) and raises EngineShutdownError at once after shutdown().
    async def update_weights_from_ipc(self, peft_config: Optional[dict] = None, base_sync_done: bool = False,
                                      use_shm: bool = False, *, manifest, buckets, version: int,
                                      drain_timeout_s: Optional[float] = 10.0, timeout_s: float = 600.0,
                                      partial: bool = False) -> dict:
        """The specification's RPC: a LoRA update when `peft_config` is given, else full weights, fed by buckets
        (in-process objects, Ray object refs, or a /dev/shm stream). A transaction: see
        `DiffusionEngine.update_weights_from_ipc` (`partial=True`: lands between two denoising steps, samples in
        flight continue with the new weights). Returns the acknowledgement."""
        ack = await asyncio.to_thread(
            self.engine.update_weights_from_ipc, peft_config, base_sync_done, use_shm,
            manifest=manifest, buckets=buckets, version=version, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s,
            partial=partial)
        return {**ack, "replica_index": self.replica_index, "node_id": self._node_id,
                "transport": transport_of(buckets, use_shm)}

    async def pause_generation(self, after_steps: int = 0, timeout_s: float = 300.0) -> dict:
        """`DiffusionEngine.pause_generation`: pause after `after_steps` more denoising steps, samples kept."""
        return await asyncio.to_thread(self.engine.pause_generation, after_steps, timeout_s)

    async def wait_for_pause(self, timeout_s: float = 60.0) -> dict:
        """Returns once the armed pause has begun (TimeoutError otherwise)."""
        return await asyncio.to_thread(self.engine.wait_for_pause, timeout_s)

    async def resume_generation(self) -> dict:
        return await asyncio.to_thread(self.engine.resume_generation)

    async def remove_lora(self, version: Optional[int] = None, timeout_s: float = 120.0) -> dict:
        return await asyncio.to_thread(self.engine.remove_lora, version, 10.0, timeout_s)

    async def sleep(self, level: int = 1, timeout_s: float = 120.0) -> dict:
        """Free the device (level 1: offload, level 2: drop the denoiser). Returns once done. Sleeping at the
        current level or lower changes nothing."""
        return await asyncio.to_thread(self.engine.sleep, level, 0.0, timeout_s)

    async def wake_up(self, timeout_s: float = 120.0) -> dict:
        """Restore the weights; an error (e.g. out of memory) or a timeout reaches the caller, nothing hangs."""
        return await asyncio.to_thread(self.engine.wake_up, timeout_s)


def _torch_threads() -> int:
    return torch.get_num_threads()


def _describe(e: ValidationError) -> str:
    return format_validation_error(e, with_input=False, empty_loc="<request>")


def create_replicas(
    n: int,
    model_path: str,
    engine_kwargs: Optional[dict] = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_concurrency: int = 1000,
    wait_ready: bool = True,
    resources: Optional[dict] = None,
    placement: Optional[Callable[[int], dict]] = None,
) -> list:
    """Start `n` RolloutReplica actors (ranks 0..n-1). With `wait_ready`, blocks until every engine is loaded so a
    bad model path or OOM surfaces here, not on the first generate. `resources`: custom Ray resources per replica;
    `placement(rank)`: extra actor options for that replica (its placement-group bundle, see
    `omniroll.rollout.ray_cluster.ActorPlacement.options`)."""
    import ray

    if n < 1:
        raise ValueError(f"replicas.count must be >= 1, got {n}")
    # Ray starts actors with OMP_NUM_THREADS=1 (or its CPU share); the OpenMP runtime reads it when torch loads, and
    # a later torch.set_num_threads(n) does not undo all of it (measured: the same engine ~5% slower). Start each
    # replica with the thread count it will use (row threads: one torch thread each).
    kwargs = engine_kwargs or {}
    row_threads = kwargs.get("row_threads", 1)  # its type and range: EngineConfig's check, in the replica
    threads = 1 if isinstance(row_threads, int) and row_threads > 1 else \
        kwargs.get("num_threads") or max(1, int(num_cpus))
    opts = dict(max_concurrency=max_concurrency, num_cpus=num_cpus, num_gpus=num_gpus,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
                **({"resources": dict(resources)} if resources else {}))
    cls = ray.remote(RolloutReplica)
    handles = [cls.options(**opts, **(placement(r) if placement else {})).remote(
        model_path, replica_index=r, engine_kwargs=engine_kwargs) for r in range(n)]
    if wait_ready:
        try:
            ray.get([h.health.remote() for h in handles])
        except BaseException:
            kill_replicas(handles)
            raise
    return handles
