"""Flat byte buckets: the unit in which weights travel from a trainer to a rollout engine.

A :class:`Bucket` is one flat ``uint8`` numpy buffer plus ``entries``, a list of
:class:`BucketEntry` ``(name, dtype_str, shape, offset, nbytes)``.  Tensors are laid out
back to back, each starting at an offset aligned to :data:`ALIGN` bytes so that the typed
views produced by :func:`unpack_bucket` are aligned.

* :func:`pack_buckets` streams ``(name, tensor)`` pairs into buckets of at most
  ``bucket_bytes`` bytes (a single tensor larger than that gets a bucket of its own).  It
  is a generator: only the bucket being filled is alive inside it, so the state dict is
  never materialised twice.
* :func:`unpack_bucket` returns zero-copy ``torch`` views over the buffer
  (``torch.frombuffer``); this also works for read-only buffers (Ray zero-copy arrays,
  read-only maps) -- the views must then be treated as read-only, which is all the
  loaders do (``param.copy_(view)``).
* :func:`plan_buckets` computes, from a :class:`WeightManifest` alone, exactly the entry
  layout :func:`pack_buckets` will produce; the shared-memory transport uses it so that the
  receiver knows every bucket's layout before the first byte arrives.

Supported dtypes: see :data:`DTYPES` (fp32/bf16/fp16 and the usual int/bool types).  bf16
needs no numpy support: bytes are copied through a ``uint8`` view of the tensor.
"""

from __future__ import annotations

import math

import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """A weight update was rejected (unknown / missing / mismatched names, protocol errors)."""


def dtype_str(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WeightSyncError(f"unsupported dtype for weight sync: {dtype}") from None


def str_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise WeightSyncError(f"unsupported dtype string: {name!r}") from None


def all_finite(t: torch.Tensor) -> bool:
    """No NaN and no Inf in ``t`` (non-floating tensors always pass). One pass, no tensor-sized temporary: a sum
    (several times faster than ``aminmax``) is finite whenever every value is, since a NaN or an Inf never leaves a
    sum; only a non-finite sum (a NaN / Inf, or finite values that overflow) takes the exact check: ``aminmax``
    propagates NaN and shows an Inf as the min or the max."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if math.isfinite(t.sum().item()):  # a Python float: no second tensor op per check
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


SMALL_TENSOR = 1 << 16  # elements: below this, summing a tensor on its own costs more in dispatch than in reading


def value_total(t: torch.Tensor) -> torch.Tensor:
    """One number that is finite whenever every value of the floating tensor ``t`` is (a NaN or an Inf never leaves
    it): the sum of squares for fp32 / fp64 (a dot product: the fastest one-pass reduction here), else the sum. It
    may also overflow on finite values: :func:`nonfinite` then checks exactly."""
    if t.dtype in (torch.float32, torch.float64):
        v = t.reshape(-1)
        return torch.dot(v, v)
    return t.sum()


def nonfinite(tensors: Sequence[torch.Tensor], totals: dict[int, torch.Tensor] | None = None) -> list[int]:
    """The positions of the tensors that hold a NaN or an Inf. Quick check over all of them at once: one
    :func:`value_total` per floating tensor (small ones, under ``SMALL_TENSOR`` elements, concatenated first), one
    sum of those per dtype and a single read-back; only a non-finite result checks tensor by tensor, exactly
    (:func:`all_finite`). ``totals``: {position: ``value_total``} already taken by the caller (e.g. while the tensor
    was hot in cache)."""
    totals = dict(totals) if totals else {}
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for i, t in enumerate(tensors):
        if i in totals or not t.is_floating_point():
            continue
        if t.numel() < SMALL_TENSOR:
            small.setdefault(t.dtype, []).append(t.reshape(-1))
        else:
            totals[i] = value_total(t)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for total in [value_total(torch.cat(group)) for group in small.values()] + list(totals.values()):
        by_dtype.setdefault(total.dtype, []).append(total)
    if all(math.isfinite(torch.stack(group).sum().item()) for group in by_dtype.values()):
        return []
    return [i for i, t in enumerate(tensors) if not all_finite(t)]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class BucketEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    """A flat uint8 buffer and the tensors laid out in it.

    An in-process bucket may instead carry `tensors`: references to the sender's own tensors (one per entry, the
    buffer left empty), so a receiver in the same process copies each byte once, straight into its parameters.
    """

    buffer: np.ndarray
    entries: list[BucketEntry]
    index: int = 0
    tensors: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes actually used (end of the last tensor)."""
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]


class ManifestEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * str_dtype(self.dtype).itemsize


@dataclass
class WeightManifest:
    """Every (name, dtype, shape) of one update; travels ahead of the buckets."""

    entries: list[ManifestEntry] = field(default_factory=list)

    @classmethod
    def from_named_tensors(cls, named: Iterable[tuple[str, torch.Tensor]]) -> "WeightManifest":
        return cls([ManifestEntry(n, dtype_str(t.dtype), tuple(t.shape)) for n, t in named])

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)


def plan_buckets(manifest: WeightManifest, bucket_bytes: int) -> list[list[BucketEntry]]:
    """The entry layout of every bucket :func:`pack_buckets` produces for these tensors."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan: list[list[BucketEntry]] = []
    cur: list[BucketEntry] = []
    off = 0
    for e in manifest.entries:
        nbytes = e.nbytes
        start = _align(off)
        if cur and start + nbytes > bucket_bytes:
            plan.append(cur)
            cur, start = [], 0
        cur.append(BucketEntry(e.name, e.dtype, tuple(e.shape), start, nbytes))
        off = start + nbytes
    if cur:
        plan.append(cur)
    return plan


def bucket_capacity(entries: Sequence[BucketEntry]) -> int:
    return max((e.offset + e.nbytes for e in entries), default=0)


def write_tensor(buffer: np.ndarray, offset: int, tensor: torch.Tensor) -> None:
    """Copy ``tensor``'s bytes into ``buffer[offset:]`` (one memcpy, any dtype incl. bf16)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    src = t.contiguous().reshape(-1).view(torch.uint8)
    n = src.numel()
    if n:
        dst = torch.from_numpy(buffer[offset : offset + n])
        dst.copy_(src)


def _view(buffer: np.ndarray, e: BucketEntry) -> torch.Tensor:
    dtype = str_dtype(e.dtype)
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    if e.offset + e.nbytes > buffer.nbytes:
        raise WeightSyncError(f"bucket entry {e.name!r} overruns the buffer ({e.offset}+{e.nbytes} > {buffer.nbytes})")
    with warnings.catch_warnings():
        # read-only buffers (Ray zero-copy, read-only maps) are fine: we only read from the views
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.frombuffer(buffer, dtype=dtype, count=e.nbytes // dtype.itemsize,
                                offset=e.offset)
    return flat.view(e.shape)


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    alloc: Callable[[int], np.ndarray] | None = None,
    by_reference: bool = False,
) -> Iterator[Bucket]:
    """Stream ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes`` bytes.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own, sized to fit it.
    ``alloc(nbytes)`` provides each bucket's buffer (default: a fresh ``np.empty`` of exactly
    the bytes used); the buffer is filled and yielded before the next tensor is looked at,
    and the pending tensors are only references (no copy until the bucket is written).
    ``by_reference=True`` (same-process receivers only) yields buckets that reference the
    tensors instead of copying them into a buffer.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    alloc = alloc or (lambda n: np.empty(n, dtype=np.uint8))
    pending: list[tuple[BucketEntry, torch.Tensor]] = []
    off = 0
    index = 0

    def flush() -> Bucket:
        if by_reference:
            return Bucket(np.empty(0, dtype=np.uint8), [e for e, _ in pending], index, [t.detach() for _, t in pending])
        buf = alloc(pending[-1][0].offset + pending[-1][0].nbytes)
        for entry, t in pending:
            write_tensor(buf, entry.offset, t)
        return Bucket(buf, [e for e, _ in pending], index)

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        start = _align(off)
        if pending and start + nbytes > bucket_bytes:
            yield flush()
            index += 1
            pending, start = [], 0
        pending.append((BucketEntry(name, dtype_str(tensor.dtype), tuple(tensor.shape), start, nbytes), tensor))
        off = start + nbytes
    if pending:
        yield flush()


def unpack_bucket(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy ``(name, tensor)`` views over ``bucket.buffer`` (or the referenced tensors)."""
    if bucket.tensors is not None:
        return [(e.name, t) for e, t in zip(bucket.entries, bucket.tensors)]
    return [(e.name, _view(bucket.buffer, e)) for e in bucket.entries]
