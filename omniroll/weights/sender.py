"""Trainer-side :class:`WeightSender`: manifest -> buckets -> every target -> all acks."""

from __future__ import annotations

import concurrent.futures as cf
from collections import Counter
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from omniroll.ray_nodes import actor_node_ids, this_node_id

from .buckets import Bucket, BucketEntry, WeightManifest, WeightSyncError, pack_buckets, plan_buckets
from .lora_format import lora_state_dict, peft_config_to_dict
from .transport import RayBucketRef, ShmChannel
from .tree import ModuleTree

TRANSPORTS = ("auto", "inproc", "object_store", "ray", "shm")


def _is_ray_target(target: Any) -> bool:
    return hasattr(getattr(target, "update_weights_from_ipc", None), "remote")


def _has_lora(module: nn.Module) -> bool:
    """Whether any module in the tree is a LoRA layer; the walk stops at the first one (a LoRA update, the trainer's
    usual one, reads only the adapter: its layers come early in the tree)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    stack = [module]
    while stack:
        m = stack.pop()
        if isinstance(m, BaseTunerLayer):
            return True
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return False


class StateReader:
    """Reads what travels for ``weights`` (see :func:`named_tensors_for`), keeping the walk of a plain module's tree
    between updates: the next update of the same module checks the tree (:meth:`ModuleTree.current`, a tenth of a
    walk) instead of walking it again, and reads every tensor afresh (a ``param.data = ...`` is followed)."""

    def __init__(self) -> None:
        self._tree: ModuleTree | None = None
        self._items: list[tuple[str, torch.Tensor]] = []

    def __call__(self, weights: Any, peft_config: dict | None) -> tuple[list[tuple[str, torch.Tensor]], dict | None]:
        tree = self._tree
        if tree is not None and tree.module is weights and tree.current():
            return [(n, t.detach()) for n, t in self._items], peft_config
        self._tree, self._items = None, []
        if isinstance(weights, nn.Module):
            if _has_lora(weights):
                return _lora_items(weights, peft_config)
            tree = ModuleTree(weights)
            items = tree.state_items()
            if items is None:
                return [(n, t.detach()) for n, t in weights.state_dict().items()], peft_config
            self._tree, self._items = tree, items
            return [(n, t.detach()) for n, t in items], peft_config
        if isinstance(weights, Mapping):
            bad = [str(k) for k, v in weights.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise WeightSyncError(f"non-tensor values for: {', '.join(bad[:20])}")
            return [(str(k), v.detach()) for k, v in weights.items()], peft_config
        raise WeightSyncError(f"cannot send weights of type {type(weights).__name__}")


def _active_peft_config(module: nn.Module) -> dict | None:
    """The module's active adapter's config as a dict, None when it has none."""
    cfgs = getattr(module, "peft_config", None) or {}
    active = getattr(module, "active_adapter", None)
    name = active if isinstance(active, str) and active in cfgs else next(iter(cfgs), None)
    return None if name is None else peft_config_to_dict(cfgs[name])


def _lora_items(weights: nn.Module, peft_config: dict | None) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    if peft_config is None:
        peft_config = _active_peft_config(weights)
    if peft_config is None:  # a container of adapted models (a two-expert denoiser): their one config
        found = [c for c in map(_active_peft_config, weights.children()) if c is not None]
        if any(c != found[0] for c in found[1:]):
            raise WeightSyncError(f"the adapted submodules have different LoRA configs ({found[0]} and "
                                  f"{next(c for c in found if c != found[0])}); pass peft_config=")
        peft_config = found[0] if found else None
    if peft_config is None:
        raise WeightSyncError("module has LoRA layers but no peft_config; pass peft_config=")
    return list(lora_state_dict(weights).items()), peft_config


def named_tensors_for(weights: Any, peft_config: dict | None) -> tuple[list[tuple[str, torch.Tensor]], dict | None]:
    """What travels for ``weights``: (name, tensor) pairs and the peft_config (None = full).

    * PEFT model / module with LoRA layers -> only the adapter (``lora_state_dict``), and
      ``peft_config`` taken from the model unless given;
    * plain ``nn.Module`` -> its ``state_dict()`` (persistent buffers included);
    * mapping -> its items as given (``peft_config`` decides full vs LoRA).
    """
    return StateReader()(weights, peft_config)


class WeightSender:
    """Pushes weight updates to ``targets`` (objects or Ray actor handles implementing
    ``update_weights_from_ipc(peft_config=None, base_sync_done=False, use_shm=False, *,
    manifest, buckets, version)``) and returns once every target has acknowledged.

    ``transport``: ``"auto"`` (the default) chooses per receiver from Ray node ids (a Ray target reports its node
    through a ``node_id()`` method): ``"shm"`` for receivers on the sender's node, ``"object_store"`` for receivers on
    other nodes (or of unknown node; one ``ray.put`` per bucket, shared by all of them), ``"inproc"`` for in-process
    targets. Forced: ``"inproc"`` (Bucket objects; a single in-process target gets a lazy iterator so only one bucket
    exists at a time), ``"object_store"`` (alias ``"ray"``: ``ray.put`` per bucket, refs sent), ``"shm"`` (a
    double-buffered /dev/shm stream; a receiver on another node is refused before any byte moves, naming it and its
    node).  By default the shm files are created and unlinked within each ``send``; ``reuse_shm=True`` keeps the two
    slot files between clean sends (allocating tmpfs pages is the dominant cost of a fresh channel) and unlinks them
    on ``close()`` / context exit / garbage collection or on any error.

    Every ack carries ``version``, ``transport`` and ``node_id`` (the receiver's node; None outside Ray). A send
    fails as a whole: it waits for every receiver, then raises one ``WeightSyncError`` naming each receiver that
    failed or is gone ("replica k on node N").
    """

    def __init__(self, targets: Iterable[Any], bucket_bytes: int = 256 << 20, transport: str = "auto", *,
                 num_shm_slots: int = 2, timeout_s: float = 600.0, reuse_shm: bool = False):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.targets = list(targets)
        if not self.targets:
            raise ValueError("WeightSender needs at least one target")
        self.bucket_bytes = int(bucket_bytes)
        self.transport = "object_store" if transport == "ray" else transport
        self.num_shm_slots = num_shm_slots
        self.timeout_s = timeout_s
        self.base_sync_done = False
        self.reuse_shm = reuse_shm
        self._chan: ShmChannel | None = None
        self._nodes: list[str | None] | None = None  # each target's Ray node id, looked up on the first send
        self._read = StateReader()  # keeps the walk of a full module's tree between sends
        self._layout: tuple[list, list[list[BucketEntry]]] = ([], [])  # manifest entries -> their bucket layout

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

    # -- where each receiver is --------------------------------------------------------
    @property
    def nodes(self) -> list[str | None]:
        """Each target's Ray node id (None: in-process, or a Ray target without ``node_id()``)."""
        if self._nodes is None:
            self._nodes = actor_node_ids(self.targets, self.timeout_s)
        return self._nodes

    def routes(self) -> list[str]:
        """The transport of each target for the next send; raises (before any byte moves) for a forced shm to a
        receiver on another node."""
        ray_targets = [_is_ray_target(t) for t in self.targets]
        if self.transport == "inproc":
            if any(ray_targets):
                raise WeightSyncError("inproc transport cannot reach Ray actors; use transport='auto', 'ray' or "
                                      "'shm'")
            return ["inproc"] * len(self.targets)
        if self.transport == "object_store":
            return ["object_store"] * len(self.targets)
        here = this_node_id() if any(ray_targets) else None
        if self.transport == "shm":
            far = [(k, n) for k, (n, r) in enumerate(zip(self.nodes, ray_targets)) if r and n and here and n != here]
            if far:
                raise WeightSyncError("transport='shm' cannot reach " + ", ".join(
                    f"replica {k} on node {n}" for k, n in far) + f": /dev/shm is shared only on the sender's node "
                    f"{here}; nothing was sent (use transport='auto' or 'ray')")
            return ["shm"] * len(self.targets)
        return ["inproc" if not r else "shm" if n is not None and n == here else "object_store"
                for n, r in zip(self.nodes, ray_targets)]

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
        named, peft_config = self._read(weights, peft_config)
        dups = sorted(n for n, c in Counter(n for n, _ in named).items() if c > 1)
        if dups:
            raise WeightSyncError(f"duplicate tensor names: {', '.join(dups[:20])}")
        routes = self.routes()
        manifest = WeightManifest.from_named_tensors(named)
        kw = dict(peft_config=peft_config, base_sync_done=self.base_sync_done, manifest=manifest, version=version)
        if partial:  # only when asked: targets without the policy (e.g. verl's server) keep working
            kw["partial"] = True
        if wait_for_inflight:
            kw.update(drain_timeout_s=None, timeout_s=self.timeout_s)
        group = {t: [k for k, r in enumerate(routes) if r == t] for t in ("inproc", "object_store", "shm")}
        acks: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = self._start_object_store(named, kw, group["object_store"]) if group["object_store"] else {}
        try:
            if group["shm"]:
                acks.update(self._send_shm(named, kw, group["shm"], errors))
            if group["inproc"]:
                acks.update(self._send_inproc(named, kw, group["inproc"]))
        finally:  # every receiver is waited for, whatever the others did
            for k, ref in pending.items():
                try:
                    acks[k] = self._result(ref) if _is_ray_target(self.targets[k]) else ref
                except Exception as e:  # noqa: BLE001 - gathered, raised once below
                    errors[k] = e
        if any(_gone(e) for e in errors.values()):  # a receiver (its node) disappeared: name every failure
            raise WeightSyncError(f"weight sync to version {version} failed as a whole (" + "; ".join(
                f"replica {k} on node {self._node_name(k)}: {_why(e)}" for k, e in sorted(errors.items())) + ")")
        if errors:  # a receiver refused the update: its own error, as it raised it
            raise next(iter(errors.values()))
        out = []
        for k in range(len(self.targets)):
            ack = acks[k]
            if isinstance(ack, dict):
                ack.setdefault("transport", routes[k])
                ack.setdefault("node_id", self.nodes[k] if routes[k] != "inproc" else None)
            out.append(ack)
        if peft_config is None:
            self.base_sync_done = True
        return out

    def _node_name(self, k: int) -> str:
        return str(self._nodes[k]) if self._nodes is not None and self._nodes[k] else "unknown"

    # -- transports ---------------------------------------------------------------------
    def _call(self, target: Any, **kw) -> Any:
        fn = target.update_weights_from_ipc
        return fn.remote(**kw) if _is_ray_target(target) else fn(**kw)

    def _send_inproc(self, named, kw, idx: list[int]) -> dict[int, Any]:
        # Same process: buckets reference the sender's tensors, so every byte is copied once, straight into the
        # receiver's parameters, and no staging memory is needed.
        buckets = self._reference_buckets(named, kw["manifest"])
        if len(idx) == 1:
            return {idx[0]: self._call(self.targets[idx[0]], buckets=buckets, use_shm=False, **kw)}  # consumed lazily
        buckets = list(buckets)
        return {k: self._call(self.targets[k], buckets=buckets, use_shm=False, **kw) for k in idx}

    def _bucket_layout(self, manifest: WeightManifest) -> list[list[BucketEntry]]:
        """``plan_buckets(manifest)``, kept while the manifest stays the same (a full update's usually does)."""
        entries, layout = self._layout
        if manifest.entries != entries:
            layout = plan_buckets(manifest, self.bucket_bytes)
            self._layout = (list(manifest.entries), layout)
        return layout

    def _reference_buckets(self, named, manifest: WeightManifest) -> Iterator[Bucket]:
        """In-process buckets that reference the tensors (``pack_buckets(by_reference=True)``'s, from the kept
        layout)."""
        tensors = iter([t for _, t in named])
        for index, entries in enumerate(self._bucket_layout(manifest)):
            yield Bucket(np.empty(0, dtype=np.uint8), entries, index, [next(tensors) for _ in entries])

    def _start_object_store(self, named, kw, idx: list[int]) -> dict[int, Any]:
        """One ``ray.put`` per bucket, shared by every receiver in ``idx``; returns their pending acks (Ray refs, or
        the ack itself for an in-process target)."""
        import ray

        refs = [RayBucketRef(ray.put(b.buffer), b.entries, b.index) for b in pack_buckets(named, self.bucket_bytes)]
        # the object store frees the buckets once every receiver dropped its refs
        return {k: self._call(self.targets[k], buckets=refs, use_shm=False, **kw) for k in idx}

    def _send_shm(self, named, kw, idx: list[int], errors: dict[int, BaseException]) -> dict[int, Any]:
        manifest: WeightManifest = kw["manifest"]
        plan = self._bucket_layout(manifest)
        if self._chan is not None and self._chan.fits(plan, len(idx)):
            chan = self._chan
            chan.reset(plan)
        else:
            self.close()
            chan = ShmChannel(plan, len(idx), self.num_shm_slots, self.timeout_s)
        keep = False
        pool = None
        futures: list[Any] = []
        try:
            targets = [self.targets[k] for k in idx]
            ray_targets = [_is_ray_target(t) for t in targets]
            if not all(ray_targets):
                pool = cf.ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="omniroll-shm")
            for j, t in enumerate(targets):
                call = dict(buckets=chan.descriptor(j), use_shm=True, **kw)
                futures.append(self._call(t, **call) if ray_targets[j] else pool.submit(self._call, t, **call))

            def check() -> None:  # a receiver that returned or raised early ends the stream
                for j, f in enumerate(futures):
                    if chan.done(j) >= len(plan):
                        continue
                    if self._ready(f) or j in chan.failed():
                        self._result(f, timeout=min(self.timeout_s, 30.0))  # re-raises the receiver's error
                        raise WeightSyncError(f"shm receiver {idx[j]} returned before consuming all buckets")

            chan.stream(named, check)
            acks = {idx[j]: self._result(f) for j, f in enumerate(futures)}  # block on the receivers, no polling
            short = [idx[j] for j in range(len(futures)) if chan.done(j) < len(plan)]
            if short:
                raise WeightSyncError(f"shm receiver(s) {short} returned before consuming all buckets")
            keep = self.reuse_shm
            return acks
        except BaseException as e:
            chan.abort()
            failed = {}
            for j, f in enumerate(futures):  # let receivers notice the abort and drop their maps
                try:
                    self._result(f, timeout=min(self.timeout_s, 30.0))
                except Exception as err:  # noqa: BLE001 - named in the one error of this send when one is gone
                    failed[idx[j]] = err
            if not isinstance(e, Exception) or not any(_gone(err) for err in failed.values()):
                raise
            errors.update(failed)
            return {}
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


def _gone(e: BaseException) -> bool:
    """Whether a receiver's error says its actor is gone (it died, or its node left the cluster)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return False
    return isinstance(e, RayActorError)


def _why(e: BaseException) -> str:
    """One line: a receiver's error, or that its actor (its node) is gone."""
    if _gone(e):
        return f"gone ({type(e).__name__}: the actor or its node died)"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"
