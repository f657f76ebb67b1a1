"""Full-weight apply: validate a whole update up front, check values as they arrive, then commit.

Two ways to land the bytes (``stage``):

* staged (the default): the module changes only in :meth:`FullWeightLoader.commit`, after the last bucket arrived
  and every check passed; a stream that fails midway leaves the module untouched. Until the commit each tensor is
  either
  - staged: copied into a staging tensor (same device and dtype as its parameter, reused across updates, see
    ``staging``) and checked there; the commit swaps each parameter's storage for its staged one (no second copy).
    Memory: one extra copy of every tensor in the update until the commit, plus the transport's bucket(s). This is
    how bytes from another process (shared memory, the object store) or another device land.
  - or held: an in-process bucket references the sender's own tensors, which stay as they are until the sender
    has every ack; on the parameter's device they are the staged copy already. They are checked as they arrive and
    copied into the parameters' own storage at the commit: no extra memory, each byte copied once.
* in place (``stage=False``): each bucket is copied straight into ``param.data`` once the whole
  bucket passed its checks; no extra memory beyond the bucket being applied (one for in-process
  streaming, two for shared memory). A stream that fails midway leaves the module partly
  updated (:attr:`FullWeightLoader.touched` says whether anything was written): the caller must
  stop using the module until a complete update lands (the engine does, see
  ``omniroll.engine.lifecycle``).

``copy_`` casts when dtypes differ (floating -> floating only).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable

import torch
from torch import nn

from .buckets import (DTYPES, SMALL_TENSOR, Bucket, WeightManifest, WeightSyncError, nonfinite, str_dtype,
                      unpack_bucket, value_total)
from .staging import StagingPool
from .tree import ModuleTree

NameMap = Callable[[str], str]
_ADAPTER_PARAM = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def peft_base_name(name: str) -> str:
    """Map a PEFT-wrapped parameter name to the plain module's name.

    ``base_model.model.x.to_q.base_layer.weight`` -> ``x.to_q.weight``.  Useful as the
    ``name_map`` when a trainer sends the base weights of a PEFT model.
    """
    while name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


def name_list(names, limit: int = 20) -> str:
    """Sorted names for an error message, the first `limit` of them and how many more."""
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _dtype_compatible(src: torch.dtype, dst: torch.dtype) -> bool:
    if src == dst:
        return True
    return src.is_floating_point and dst.is_floating_point


def _targets_of(tree: ModuleTree) -> tuple[dict[str, torch.Tensor], set[str]]:
    """What a full update may address, {name: parameter or buffer}, and the names of the parameters, read from the
    module's tree: what ``named_parameters()`` and ``named_buffers()`` name. With a LoRA adapter injected, base
    weights live under ".base_layer." and the adapter's own parameters are not part of a full update: a base weight
    is addressed by its plain name (``to_q.weight``, not ``to_q.base_layer.weight``)."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    for prefix, m in tree.unique_modules():
        for k, p in m._parameters.items():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                name = _plain(prefix + k)
                if name is not None:
                    params[name] = p
        for k, b in m._buffers.items():
            if b is not None and id(b) not in seen_buffers:
                seen_buffers.add(id(b))
                name = _plain(prefix + k)
                if name is not None:
                    buffers.setdefault(name, b)
    targets = dict(params)
    for name, b in buffers.items():
        targets.setdefault(name, b)
    return targets, set(params)


def _plain(name: str) -> str | None:
    """A weight's name as a full update addresses it; None for a LoRA adapter's own parameter."""
    if ".lora_" in name and _ADAPTER_PARAM.search(name):
        return None
    return name.replace(".base_layer.", ".")


def _nonfinite(names: list[str], index: int) -> WeightSyncError:
    return WeightSyncError(f"weight update rejected: non-finite values (NaN or Inf) in tensor(s) {name_list(names)} "
                           f"(bucket {index})")


class FullWeightLoader:
    """Applies one full (or ``allow_partial``) weight update to ``module`` in place.

    Usage: ``begin(manifest)`` -> ``load_bucket(b)`` for every bucket -> ``finish()``
    (= ``check_complete()`` then ``commit()``).
    ``begin`` validates every name (after ``name_map``), shape and dtype before anything is
    touched; a dtype mismatch is accepted only floating -> floating (cast by ``copy_``).
    ``load_bucket`` checks the bucket against the manifest and every floating tensor for NaN / Inf
    before any of its bytes land; a non-finite tensor rejects the update, naming the tensor.
    If the module carries an injected LoRA adapter, names address the base weights by their
    plain names (``to_q.weight``, not ``to_q.base_layer.weight``) and the adapter stays.
    """

    def __init__(self, module: nn.Module, name_map: NameMap | None = None, *, allow_partial: bool = False,
                 stage: bool = True, staging: StagingPool | None = None):
        self.module = module
        self.staging = staging if staging is not None else StagingPool()  # the receiver's pool: reused across updates
        self.name_map = name_map
        self.allow_partial = allow_partial
        self.stage = stage
        self._staged: dict[str, torch.Tensor] = {}  # target name -> staged value (stage=True)
        self._held: list[tuple[str, torch.Tensor]] = []  # (target name, in-process bucket tensor) (stage=True)
        self.touched = False  # whether any byte of the module was written (stage=False)
        kept = self.staging.kept_targets(module)  # the targets read at the last update, if the tree is unchanged
        if kept is None:
            tree = ModuleTree(module)
            kept = _targets_of(tree)
            self.staging.keep_targets(tree, kept)
        self._targets, self._params = kept
        self._plan: dict[str, str] | None = None  # source name -> target name
        self._received: set[str] = set()
        self.bytes_loaded = 0
        self.max_bucket_bytes = 0

    def _map(self, name: str) -> str:
        return self.name_map(name) if self.name_map else name

    def begin(self, manifest: WeightManifest) -> None:
        plan: dict[str, str] = {}
        unknown, dup, clash, bad_shape, bad_dtype = [], [], [], [], []
        target_of: dict[str, str] = {}
        for e in manifest.entries:
            if e.name in plan:
                dup.append(e.name)
                continue
            tgt = self._map(e.name)
            t = self._targets.get(tgt)
            if t is None:
                unknown.append(e.name if tgt == e.name else f"{e.name} -> {tgt}")
                continue
            if tgt in target_of:
                clash.append(f"{target_of[tgt]} & {e.name} -> {tgt}")
                continue
            target_of[tgt] = e.name
            plan[e.name] = tgt
            if t.shape != e.shape and tuple(t.shape) != tuple(e.shape):  # a torch.Size equals its tuple
                bad_shape.append(f"{e.name}: sent {tuple(e.shape)} vs module {tuple(t.shape)}")
            if DTYPES.get(e.dtype) is not t.dtype and not _dtype_compatible(str_dtype(e.dtype), t.dtype):
                bad_dtype.append(f"{e.name}: sent {e.dtype} vs module {t.dtype}")
        missing = [] if self.allow_partial else sorted(self._params - set(target_of))
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unknown name(s): {name_list(unknown)}")
        if missing:
            problems.append(f"{len(missing)} missing parameter(s): {name_list(missing)}")
        if dup:
            problems.append(f"duplicate name(s): {name_list(dup)}")
        if clash:
            problems.append(f"name_map collision(s): {name_list(clash)}")
        if bad_shape:
            problems.append(f"shape mismatch: {name_list(bad_shape)}")
        if bad_dtype:
            problems.append(f"dtype mismatch: {name_list(bad_dtype)}")
        if problems:
            raise WeightSyncError("weight update rejected, nothing applied; " + "; ".join(problems))
        self._plan = plan
        self._manifest = {e.name: e for e in manifest.entries}
        self._received = set()
        self._staged, self._held = {}, []
        self.bytes_loaded = 0

    def load_bucket(self, bucket: Bucket) -> None:
        if self._plan is None:
            raise WeightSyncError("load_bucket() before begin()")
        # validate the whole bucket against the manifest before copying any of it
        manifest, received = self._manifest, self._received
        if any((m := manifest.get(e.name)) is None or e.name in received or m != e[:3] for e in bucket.entries):
            self._reject_bucket(bucket)
        if len({e.name for e in bucket.entries}) != len(bucket.entries):
            dup = sorted(n for n, c in Counter(e.name for e in bucket.entries).items() if c > 1)
            raise WeightSyncError(f"bucket {bucket.index} inconsistent with the manifest: {name_list(dup)} "
                                  f"(received twice)")
        views = unpack_bucket(bucket)
        if self.stage and bucket.tensors is not None and self._same_devices(views):
            self._hold_bucket(bucket.index, views)
        elif self.stage:
            self._stage_bucket(bucket.index, views)
        else:
            bad_values = nonfinite([src for _, src in views])
            if bad_values:
                raise _nonfinite([views[i][0] for i in bad_values], bucket.index)
            with torch.no_grad():
                for name, src in views:
                    self.touched = True
                    self._targets[self._plan[name]].data.copy_(src)
                    self._received.add(name)
        self.bytes_loaded += bucket.nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, int(bucket.buffer.nbytes))

    def _reject_bucket(self, bucket: Bucket) -> None:
        """Raise naming every entry of ``bucket`` the manifest does not have as it is (where the quick check found
        one); return if the difference was only in how a shape was spelled (a list for a tuple)."""
        bad = []
        for e in bucket.entries:
            m = self._manifest.get(e.name)
            if m is None:
                bad.append(f"{e.name} (not in manifest)")
            elif e.name in self._received:
                bad.append(f"{e.name} (received twice)")
            elif m.dtype != e.dtype or tuple(m.shape) != tuple(e.shape):
                bad.append(f"{e.name} (bucket {e.dtype}{tuple(e.shape)} vs manifest {m.dtype}{tuple(m.shape)})")
        if bad:
            raise WeightSyncError(f"bucket {bucket.index} inconsistent with the manifest: {name_list(bad)}")

    def _stage_bucket(self, index: int, views: list) -> None:
        """Copy each tensor into its staging tensor and sum the copy while it is hot in cache (the module is not
        touched before the commit, so checking after the copy changes nothing but the speed; see :func:`nonfinite`
        for the check)."""
        plan, targets, take, staged_of = self._plan, self._targets, self.staging.take, self._staged
        staged, totals = [], {}
        with torch.no_grad():
            for name, src in views:
                target = plan[name]
                t = take(target, targets[target]).copy_(src)
                staged_of[target] = t
                if t.is_floating_point() and t.numel() >= SMALL_TENSOR:
                    totals[len(staged)] = value_total(t)
                staged.append(t)
            bad = nonfinite(staged, totals)
        self._received.update(name for name, _ in views)
        if bad:
            raise _nonfinite([views[i][0] for i in bad], index)

    def _same_devices(self, views: list) -> bool:
        """Whether every tensor is on its target's device: then holding it until the commit costs nothing more than
        staging it. From another device (a host stream for a GPU model) it is staged: the transfer and the check run
        on the target's device while the engine still serves, and the commit only swaps."""
        plan, targets = self._plan, self._targets
        return all(src.get_device() == targets[plan[name]].get_device() for name, src in views)

    def _hold_bucket(self, index: int, views: list) -> None:
        """An in-process bucket references the sender's own tensors, which stay as they are until the sender has
        every ack: they are the staged copy. Check them now, keep them, copy them in at the commit."""
        with torch.no_grad():
            bad = nonfinite([src for _, src in views])
        if bad:
            raise _nonfinite([views[i][0] for i in bad], index)
        plan = self._plan
        self._held.extend((plan[name], src) for name, src in views)
        self._received.update(name for name, _ in views)

    def check_complete(self) -> dict:
        """Raise unless every manifest name arrived; returns the stats of the update."""
        if self._plan is None:
            raise WeightSyncError("check_complete() before begin()")
        never = sorted(set(self._plan) - self._received)
        if never:
            self._plan, self._staged, self._held = None, {}, []
            raise WeightSyncError(f"update incomplete: {len(never)} manifest name(s) never received: "
                                  f"{name_list(never)}")
        return {"num_tensors": len(self._received), "num_bytes": self.bytes_loaded,
                "max_bucket_bytes": self.max_bucket_bytes}

    def commit(self) -> None:
        """Land the update (cannot fail: names, shapes and values were checked). A staged tensor is swapped in: its
        parameter keeps its identity and takes the staged storage (no second copy), and the old storage goes to the
        staging pool, to stage the next update into. A held tensor (an in-process bucket's) is copied into the
        parameter's own storage."""
        targets = self._targets
        with torch.no_grad():
            for name, value in self._staged.items():
                previous = targets[name].data
                targets[name].data = value
                self.staging.give(name, previous)
            if self._held:  # one call for all; the last checked first, while it is still in cache
                held = self._held[::-1]
                torch._foreach_copy_([targets[name] for name, _ in held], [src for _, src in held])
        self._staged, self._held = {}, []
        self._plan = None

    def finish(self) -> dict:
        stats = self.check_complete()
        self.commit()
        return stats
