"""How buckets travel from a trainer to a receiver.

* in-process: the :class:`~omniroll.weights.buckets.Bucket` objects themselves (a list, or a
  lazy iterator for a single target so only one bucket exists at a time);
* Ray: :class:`RayBucketRef` -- ``ray.put(bucket.buffer)`` plus the entry metadata; the
  receiver ``ray.get``s one bucket at a time and gets a zero-copy read-only numpy array.
  All buckets of one update sit in the object store until the receivers acknowledge;
* shared memory (``use_shm=True``): :class:`ShmStream` -- a double-buffered stream through
  files in ``/dev/shm``.  The sender knows every bucket's layout up front
  (:func:`~omniroll.weights.buckets.plan_buckets`), creates ``num_slots`` slot files of one
  bucket each plus a small control file, and fills slot ``i % num_slots`` with bucket ``i``
  while the receivers copy the previous one.  Control file (int64 words): ``[0]`` buckets
  ready, ``[1]`` abort flag, ``[2 + 2k]`` buckets done by receiver ``k``, ``[3 + 2k]`` its
  error flag.  Only the sender creates and unlinks files (:meth:`ShmChannel.close`, always
  run from a ``finally``), so nothing is left in /dev/shm even when a receiver fails.
  Receivers must run on the sender's node (the sender checks Ray node ids before any byte moves), and open only
  files a sender created (`check_shm_stream`: the control file is mapped read-write).

Ordering: a writer stores data, then the counter; a reader loads the counter, then data.  A
``threading.Lock`` acquire/release pair (an atomic read-modify-write in CPython) sits between
the two on both sides as a memory fence.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .buckets import Bucket, BucketEntry, WeightSyncError, bucket_capacity

SHM_DIR = "/dev/shm"
SHM_PREFIX = "omniroll-ws-"
#: the names a sender gives its files: SHM_PREFIX, its pid and a random tag, then "ctrl" or "slot<k>"
_SHM_NAME = re.compile(rf"^{re.escape(SHM_PREFIX)}(\d+-[0-9a-f]{{12}})-(ctrl|slot\d+)$")
_FENCE = threading.Lock()


def _fence() -> None:
    _FENCE.acquire()
    _FENCE.release()


@dataclass
class RayBucketRef:
    """A bucket in the Ray object store: ``ref`` resolves to the flat uint8 buffer."""

    ref: Any
    entries: list[BucketEntry]
    index: int = 0


@dataclass
class ShmStream:
    """What a shared-memory receiver gets: everything needed to map and follow the stream."""

    slots: list[str]
    ctrl: str
    plan: list[list[BucketEntry]]
    slot_bytes: int
    receiver: int
    timeout_s: float = 600.0


def _wait(cond: Callable[[], bool], timeout_s: float, what: str, check: Callable[[], None] | None = None) -> None:
    """Poll ``cond`` (spin briefly, then sleep up to 1 ms); ``check`` may raise to abort."""
    deadline = time.monotonic() + timeout_s
    spins = 0
    last_check = 0.0
    while not cond():
        spins += 1
        now = time.monotonic()
        if check is not None and now - last_check > 0.005:
            check()
            last_check = now
        if now > deadline:
            raise WeightSyncError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0 if spins < 20 else min(5e-4, 2e-5 * spins))
    _fence()


class _Map:
    """A file in /dev/shm mapped into this process as a uint8 array."""

    def __init__(self, path: str, size: int, create: bool, writable: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0) if writable else os.O_RDONLY
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)  # never through a link
        try:
            if create:
                os.ftruncate(fd, size)
            # MAP_POPULATE: fault every page in one go (per-page faults on tmpfs are the main cost)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        self.array = None
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the last view
            pass


class ShmChannel:
    """Sender side of a shared-memory stream (creates, fills and finally unlinks the files)."""

    def __init__(self, plan: list[list[BucketEntry]], num_receivers: int, num_slots: int = 2,
                 timeout_s: float = 600.0):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.plan = plan
        self.num_receivers = num_receivers
        self.num_slots = min(num_slots, max(1, len(plan)))
        self.slot_bytes = max([bucket_capacity(p) for p in plan] + [1])
        self.timeout_s = timeout_s
        tag = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.paths: list[str] = []
        self._maps: list[_Map] = []
        try:
            self.ctrl_path = os.path.join(SHM_DIR, f"{tag}-ctrl")
            self._ctrl_map = self._open(self.ctrl_path, 8 * (2 + 2 * num_receivers))
            self.ctrl = self._ctrl_map.array.view(np.int64)
            self.slot_paths = [os.path.join(SHM_DIR, f"{tag}-slot{k}") for k in range(self.num_slots)]
            self.slots = [self._open(p, self.slot_bytes).array for p in self.slot_paths]
        except BaseException:
            self.close()
            raise

    def _open(self, path: str, size: int) -> _Map:
        self.paths.append(path)
        m = _Map(path, size, create=True, writable=True)
        self._maps.append(m)
        return m

    def fits(self, plan: list[list[BucketEntry]], num_receivers: int) -> bool:
        """Whether this channel's files can carry ``plan`` (for reuse across updates)."""
        return (bool(self._maps) and num_receivers == self.num_receivers and
                max([bucket_capacity(p) for p in plan] + [1]) <= self.slot_bytes)

    def reset(self, plan: list[list[BucketEntry]]) -> None:
        """Start a new update on the same files (all receivers of the last one have returned)."""
        self.plan = plan
        self.ctrl[:] = 0

    def descriptor(self, receiver: int) -> ShmStream:
        return ShmStream(list(self.slot_paths), self.ctrl_path, self.plan, self.slot_bytes, receiver, self.timeout_s)

    def done(self, receiver: int) -> int:
        return int(self.ctrl[2 + 2 * receiver])

    def failed(self) -> list[int]:
        return [k for k in range(self.num_receivers) if self.ctrl[3 + 2 * k]]

    def stream(self, tensors: Iterable, check: Callable[[], None] | None = None) -> int:
        """Write every planned bucket from ``tensors`` ((name, tensor) pairs, plan order)."""
        from .buckets import write_tensor

        it = iter(tensors)
        bytes_written = 0
        for i, entries in enumerate(self.plan):
            need = i - self.num_slots + 1  # the slot's previous bucket must be done everywhere

            def check_all() -> None:
                if check is not None:
                    check()  # may re-raise a receiver's own error
                bad = self.failed()
                if bad:
                    raise WeightSyncError(f"shm receiver(s) {bad} failed")

            _wait(lambda: all(self.done(k) >= need for k in range(self.num_receivers)), self.timeout_s,
                  f"receivers to release slot {i % self.num_slots}", check_all)
            buf = self.slots[i % self.num_slots]
            for e in entries:
                name, t = next(it)
                if name != e.name:
                    raise WeightSyncError(f"tensor order changed while streaming: got {name!r}, planned {e.name!r}")
                write_tensor(buf, e.offset, t)
                bytes_written += e.nbytes
            _fence()
            self.ctrl[0] = i + 1
        return bytes_written

    def abort(self) -> None:
        if self._maps and self.ctrl is not None:
            self.ctrl[1] = 1

    def close(self) -> None:
        """Unmap and unlink every file (idempotent)."""
        for m in self._maps:
            m.close()
        self._maps = []
        self.ctrl = None
        self.slots = []
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.paths = []


def check_shm_stream(stream: ShmStream) -> None:
    """A receiver opens only what a sender of this module created: regular files (not links) of this user directly in
    /dev/shm, named as `ShmChannel` names them (one tag for all; the control file, then slot k at index k), large
    enough for the layout the descriptor declares. Raises WeightSyncError naming the field, before anything is
    opened (the control file is mapped read-write: a descriptor naming any other file would have it written)."""
    if isinstance(stream.receiver, bool) or not isinstance(stream.receiver, int) or stream.receiver < 0:
        raise WeightSyncError(f"ShmStream.receiver must be an int >= 0, got {stream.receiver!r}")
    if not isinstance(stream.slots, list) or not stream.slots:
        raise WeightSyncError("ShmStream.slots must be a non-empty list of /dev/shm paths")
    sizes = {"ctrl": 8 * (2 + 2 * (stream.receiver + 1)), "slot": max([bucket_capacity(p) for p in stream.plan] + [1])}
    tags = set()
    for field, path, role in [("ctrl", stream.ctrl, "ctrl")] + [(f"slots[{k}]", p, f"slot{k}")
                                                                 for k, p in enumerate(stream.slots)]:
        m = _SHM_NAME.match(os.path.basename(path)) if isinstance(path, str) else None
        if m is None or os.path.dirname(path) != SHM_DIR or m.group(2) != role:
            raise WeightSyncError(f"ShmStream.{field}: {path!r} is not a file a weight sender creates (expected "
                                  f"{SHM_DIR}/{SHM_PREFIX}<pid>-<tag>-{role}); nothing was opened")
        tags.add(m.group(1))
        try:
            st = os.lstat(path)
        except OSError as e:
            raise WeightSyncError(f"ShmStream.{field}: {path!r}: {e.strerror}; nothing was opened") from None
        need = sizes["ctrl" if role == "ctrl" else "slot"]
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < need:
            raise WeightSyncError(f"ShmStream.{field}: {path!r} is not a regular file of this user of at least {need} "
                                  f"bytes (a sender's own file); nothing was opened")
    if len(tags) != 1:
        raise WeightSyncError(f"ShmStream: ctrl and slots come from different senders ({sorted(tags)}); nothing was "
                              f"opened")


def iter_shm_buckets(stream: ShmStream) -> Iterator[Bucket]:
    """Receiver side: yield each bucket as it becomes ready, acknowledge it on resume. The descriptor is checked first
    (`check_shm_stream`).

    The yielded bucket's buffer is a read-only view of a slot that is reused once the bucket
    is acknowledged: copy out of it before asking for the next one.
    """
    check_shm_stream(stream)
    ctrl = _Map(stream.ctrl, 0, create=False, writable=True)
    c = ctrl.array.view(np.int64)
    slots = [_Map(p, 0, create=False, writable=False) for p in stream.slots]
    done_idx, err_idx = 2 + 2 * stream.receiver, 3 + 2 * stream.receiver
    completed = False

    def check() -> None:
        if c[1]:
            raise WeightSyncError("shm sender aborted the update")

    try:
        for i, entries in enumerate(stream.plan):
            _wait(lambda: int(c[0]) > i, stream.timeout_s, f"bucket {i} from the sender", check)
            buf = slots[i % len(slots)].array[: bucket_capacity(entries)]
            yield Bucket(buf, list(entries), i)
            del buf
            _fence()
            c[done_idx] = i + 1
        completed = True
    finally:
        if not completed:
            c[err_idx] = 1
        c = None  # the view goes before its mapping closes
        for m in slots + [ctrl]:
            m.close()


def leftover_shm(prefix: str = SHM_PREFIX) -> list[str]:
    """Files of this module still in /dev/shm (for tests and diagnostics)."""
    try:
        return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))
    except FileNotFoundError:
        return []


def resolve_buckets(buckets: Any, use_shm: bool = False) -> Iterator[Bucket]:
    """Turn any transport's bucket descriptors into an iterator of Buckets.

    Accepts: a :class:`ShmStream` (or a one-element list of it), an iterable of
    :class:`Bucket`, :class:`RayBucketRef`, or raw Ray ``ObjectRef`` s resolving to a Bucket.
    The descriptor kind is checked eagerly; buckets are resolved lazily, one at a time.
    """
    buckets = check_descriptor(buckets, use_shm)
    if isinstance(buckets, ShmStream):
        return iter_shm_buckets(buckets)
    return _resolve_each(buckets)


def transport_of(buckets: Any, use_shm: bool) -> str:
    """Which transport a descriptor came by, as acks name it: "shm", "object_store" or "inproc"."""
    if use_shm or isinstance(buckets, ShmStream):
        return "shm"
    first = buckets[0] if isinstance(buckets, (list, tuple)) and buckets else None
    if isinstance(first, ShmStream):
        return "shm"
    if isinstance(first, RayBucketRef) or type(first).__name__ == "ObjectRef":
        return "object_store"
    return "inproc"


def check_descriptor(buckets: Any, use_shm: bool) -> Any:
    """The descriptor's kind agrees with ``use_shm`` (checked before anything is read); returns it unwrapped."""
    if isinstance(buckets, (list, tuple)) and len(buckets) == 1 and isinstance(buckets[0], ShmStream):
        buckets = buckets[0]
    if use_shm and not isinstance(buckets, ShmStream):
        raise WeightSyncError(f"use_shm=True but buckets is a {type(buckets).__name__}, not a ShmStream")
    if isinstance(buckets, ShmStream):
        check_shm_stream(buckets)
    return buckets


def _resolve_each(buckets: Iterable[Any]) -> Iterator[Bucket]:
    for b in buckets:
        if isinstance(b, Bucket):
            yield b
        elif isinstance(b, RayBucketRef):
            import ray

            yield Bucket(ray.get(b.ref), list(b.entries), b.index)
        elif type(b).__name__ == "ObjectRef":
            import ray

            obj = ray.get(b)
            if not isinstance(obj, Bucket):
                raise WeightSyncError(f"ObjectRef resolved to {type(obj).__name__}, expected Bucket")
            yield obj
        else:
            raise WeightSyncError(f"unknown bucket descriptor type {type(b).__name__}")
