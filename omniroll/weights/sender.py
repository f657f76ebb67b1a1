"""Trainer-side :class:`WeightSender`: manifest -> buckets -> every target -> all acks."""

from __future__ import annotations

import concurrent.futures as cf
from collections import Counter
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .buckets import Bucket, WeightManifest, WeightSyncError, pack_buckets, plan_buckets
from .lora import lora_state_dict, peft_config_to_dict
from .transport import RayBucketRef, ShmChannel

TRANSPORTS = ("inproc", "ray", "shm")


def _is_ray_target(target: Any) -> bool:
    return hasattr(getattr(target, "update_weights_from_ipc", None), "remote")


def _has_lora(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def named_tensors_for(weights: Any, peft_config: dict | None) -> tuple[list[tuple[str, torch.Tensor]], dict | None]:
    """What travels for ``weights``: (name, tensor) pairs and the peft_config (None = full).

    * PEFT model / module with LoRA layers -> only the adapter (``lora_state_dict``), and
      ``peft_config`` taken from the model unless given;
    * plain ``nn.Module`` -> its ``state_dict()`` (persistent buffers included);
    * mapping -> its items as given (``peft_config`` decides full vs LoRA).
    """
    if isinstance(weights, nn.Module):
        if _has_lora(weights):
            if peft_config is None:
                cfgs = getattr(weights, "peft_config", None) or {}
                active = getattr(weights, "active_adapter", None)
                name = active if isinstance(active, str) and active in cfgs else next(iter(cfgs), None)
                if name is None:
                    raise WeightSyncError("module has LoRA layers but no peft_config; pass peft_config=")
                peft_config = peft_config_to_dict(cfgs[name])
            return list(lora_state_dict(weights).items()), peft_config
        return [(n, t.detach()) for n, t in weights.state_dict().items()], peft_config
    if isinstance(weights, Mapping):
        bad = [str(k) for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise WeightSyncError(f"non-tensor values for: {', '.join(bad[:20])}")
        return [(str(k), v.detach()) for k, v in weights.items()], peft_config
    raise WeightSyncError(f"cannot send weights of type {type(weights).__name__}")


class WeightSender:
    """Pushes weight updates to ``targets`` (objects or Ray actor handles implementing
    ``update_weights_from_ipc(peft_config=None, base_sync_done=False, use_shm=False, *,
    manifest, buckets, version)``) and returns once every target has acknowledged.

    ``transport``: ``"inproc"`` (Bucket objects; a single in-process target gets a lazy
    iterator so only one bucket exists at a time), ``"ray"`` (``ray.put`` per bucket, refs
    sent), ``"shm"`` (double-buffered /dev/shm stream, same host only).  By default the shm
    files are created and unlinked within each ``send``; ``reuse_shm=True`` keeps the two
    slot files between clean sends (allocating tmpfs pages is the dominant cost of a fresh
    channel) and unlinks them on ``close()`` / context exit / garbage collection or on any
    error.
    """

    def __init__(self, targets: Iterable[Any], bucket_bytes: int = 256 << 20, transport: str = "inproc", *,
                 num_shm_slots: int = 2, timeout_s: float = 600.0, reuse_shm: bool = False):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.targets = list(targets)
        if not self.targets:
            raise ValueError("WeightSender needs at least one target")
        self.bucket_bytes = int(bucket_bytes)
        self.transport = transport
        self.num_shm_slots = num_shm_slots
        self.timeout_s = timeout_s
        self.base_sync_done = False
        self.reuse_shm = reuse_shm
        self._chan: ShmChannel | None = None

    def close(self) -> None:
        """Unlink the kept shared-memory files (``reuse_shm=True``); idempotent."""
        chan, self._chan = getattr(self, "_chan", None), None
        if chan is not None:
            chan.close()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def send(self, weights: Any, version: int, peft_config: dict | None = None, *, partial: bool = False,
             wait_for_inflight: bool = False) -> list[dict]:
        """Push ``weights`` as ``version`` to every target; returns their acks. The samples in flight on a target
        (see ``DiffusionEngine.update_weights_from_ipc``): by default they finish on the old weights for up to the
        target's drain timeout and what still runs then is aborted; ``wait_for_inflight=True``: the update waits for
        all of them (up to this sender's ``timeout_s``), none is aborted; either way no sample spans two versions.
        ``partial=True``: the update lands between two denoising steps and they continue with the new weights."""
        for name, value in (("partial", partial), ("wait_for_inflight", wait_for_inflight)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if partial and wait_for_inflight:
            raise ValueError("partial=True and wait_for_inflight=True exclude each other: a partial update lands "
                             "between two steps of the samples in flight, it does not wait for them")
        named, peft_config = named_tensors_for(weights, peft_config)
        dups = sorted(n for n, c in Counter(n for n, _ in named).items() if c > 1)
        if dups:
            raise WeightSyncError(f"duplicate tensor names: {', '.join(dups[:20])}")
        manifest = WeightManifest.from_named_tensors(named)
        kw = dict(peft_config=peft_config, base_sync_done=self.base_sync_done, manifest=manifest, version=version)
        if partial:  # only when asked: targets without the policy (e.g. verl's server) keep working
            kw["partial"] = True
        if wait_for_inflight:
            kw.update(drain_timeout_s=None, timeout_s=self.timeout_s)
        if self.transport == "shm":
            acks = self._send_shm(named, kw)
        elif self.transport == "ray":
            acks = self._send_ray(named, kw)
        else:
            acks = self._send_inproc(named, kw)
        if peft_config is None:
            self.base_sync_done = True
        return acks

    # -- transports ---------------------------------------------------------------------
    def _call(self, target: Any, **kw) -> Any:
        fn = target.update_weights_from_ipc
        return fn.remote(**kw) if _is_ray_target(target) else fn(**kw)

    def _send_inproc(self, named, kw) -> list[dict]:
        if any(_is_ray_target(t) for t in self.targets):
            raise WeightSyncError("inproc transport cannot reach Ray actors; use transport='ray' or 'shm'")
        # Same process: buckets reference the sender's tensors, so every byte is copied once, straight into the
        # receiver's parameters, and no staging memory is needed.
        if len(self.targets) == 1:
            buckets = pack_buckets(named, self.bucket_bytes, by_reference=True)  # consumed lazily
            return [self._call(self.targets[0], buckets=buckets, use_shm=False, **kw)]
        buckets: list[Bucket] = list(pack_buckets(named, self.bucket_bytes, by_reference=True))
        return [self._call(t, buckets=buckets, use_shm=False, **kw) for t in self.targets]

    def _send_ray(self, named, kw) -> list[dict]:
        import ray

        refs = [RayBucketRef(ray.put(b.buffer), b.entries, b.index) for b in pack_buckets(named, self.bucket_bytes)]
        try:
            results = [self._call(t, buckets=refs, use_shm=False, **kw) for t in self.targets]
            return [ray.get(r, timeout=self.timeout_s) if isinstance(r, ray.ObjectRef) else r for r in results]
        finally:
            del refs  # the object store frees the buckets once receivers dropped theirs

    def _send_shm(self, named, kw) -> list[dict]:
        manifest: WeightManifest = kw["manifest"]
        plan = plan_buckets(manifest, self.bucket_bytes)
        if self._chan is not None and self._chan.fits(plan, len(self.targets)):
            chan = self._chan
            chan.reset(plan)
        else:
            self.close()
            chan = ShmChannel(plan, len(self.targets), self.num_shm_slots, self.timeout_s)
        keep = False
        pool = None
        futures: list[Any] = []
        try:
            ray_targets = [_is_ray_target(t) for t in self.targets]
            if not all(ray_targets):
                pool = cf.ThreadPoolExecutor(max_workers=len(self.targets), thread_name_prefix="omniroll-shm")
            for k, t in enumerate(self.targets):
                call = dict(buckets=chan.descriptor(k), use_shm=True, **kw)
                futures.append(self._call(t, **call) if ray_targets[k] else pool.submit(self._call, t, **call))

            def check() -> None:  # a receiver that returned or raised early ends the stream
                for k, f in enumerate(futures):
                    if chan.done(k) >= len(plan):
                        continue
                    if self._ready(f) or k in chan.failed():
                        self._result(f, timeout=min(self.timeout_s, 30.0))  # re-raises the receiver's error
                        raise WeightSyncError(f"shm receiver {k} returned before consuming all buckets")

            chan.stream(named, check)
            acks = [self._result(f) for f in futures]  # block on the receivers, no polling
            short = [k for k in range(len(futures)) if chan.done(k) < len(plan)]
            if short:
                raise WeightSyncError(f"shm receiver(s) {short} returned before consuming all buckets")
            keep = self.reuse_shm
            return acks
        except BaseException:
            chan.abort()
            for f in futures:  # let receivers notice the abort and drop their maps
                try:
                    self._result(f, timeout=min(self.timeout_s, 30.0))
                except Exception:
                    pass
            raise
        finally:
            if keep:  # only after a clean update; any error unlinks right away
                self._chan = chan
            else:
                self._chan = None
                chan.close()
            if pool is not None:
                pool.shutdown(wait=False)

    @staticmethod
    def _ready(f: Any) -> bool:
        if isinstance(f, cf.Future):
            return f.done()
        import ray

        ready, _ = ray.wait([f], timeout=0)
        return bool(ready)

    def _result(self, f: Any, timeout: float | None = None) -> Any:
        timeout = self.timeout_s if timeout is None else timeout
        if isinstance(f, cf.Future):
            return f.result(timeout=timeout)
        import ray

        return ray.get(f, timeout=timeout)
