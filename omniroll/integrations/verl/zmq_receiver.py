"""Receiving end of verl's bucketed ZMQ weight stream (verl 0.9.1 `BucketedWeightSender`, which VeRL-Omni's actor uses
for its LoRA fast path): :func:`receive_zmq_stream` reads the whole stream into host memory, so that the caller can
apply it as one omniroll transaction (check, receive, commit: ``omniroll.weights.update``).

The wire format (verl's, all messages pickled with ``send_pyobj``; the sender binds a REQ socket, we connect a REP):

1. the buffer: ``{"name": shm_name, "size": nbytes}`` (``use_shm=True``: a POSIX shared-memory segment, /dev/shm/NAME)
   or a CUDA-IPC handle of a uint8 device buffer (``use_shm=False``); we answer ``b""``;
2. one message per bucket: ``{"bucket_meta": {name: {"name", "shape", "dtype", "offset", "handle"}}, "is_last"}``;
   a tensor is ``buffer[offset : offset + nbytes]`` viewed as ``dtype`` / ``shape`` (``handle`` set: a tensor sent on
   its own through CUDA IPC); we answer ``b""`` once we copied it out (the sender then reuses the buffer); the answer
   to the last bucket comes after the buffer is released.

Only shared memory is read here (CPU tensors). A CUDA-IPC stream (``use_shm=False``) would need the receiver on a
process that sees the sender's GPU, rebuilding each handle with ``torch.multiprocessing.reductions`` on its own device
index (verl's ``rebuild_ipc``), a device synchronize before each answer, and the buffer released before the last
answer; it is refused here, after the stream was drained (see below).

The receiver always completes the protocol, even when it will refuse the update: verl's sender waits for every
answer with no timeout, so a receiver that stopped answering would hang the trainer. Errors (a CUDA-IPC handle, a
bucket it cannot read) are raised after the last bucket was answered. A sender that goes silent for ``timeout_s``
ends the call with a :class:`WeightSyncError`.

The protocol is pickle (``send_pyobj`` / ``recv_pyobj``): whoever binds the socket can run code in the receiver. So
the socket is a trust boundary: only an ``ipc://`` path inside :func:`private_socket_dir` (a directory owned by this
user, mode 0700, so no other user can bind, squat or connect there) is accepted; a TCP address, or a path elsewhere
(``/tmp`` itself, where another user could bind the predictable name first), is refused before connecting.
"""

from __future__ import annotations

import mmap
import os
import pickle
import stat
import tempfile
from typing import Optional

import torch

from omniroll.weights.buckets import WeightSyncError

SHM_DIR = "/dev/shm"


def private_socket_dir() -> str:
    """The directory of this user's ZMQ weight sockets: ``<tmp>/omniroll-zmq-<uid>``, created with mode 0700; one
    that exists with another owner or wider permissions (or is not a directory) is refused."""
    uid = os.getuid()
    path = os.path.join(tempfile.gettempdir(), f"omniroll-zmq-{uid}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise PermissionError(f"{path}: the ZMQ weight-socket directory must be a directory of uid {uid} with mode "
                              f"0700 (it has uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}); remove it")
    return path


def check_socket_handle(zmq_handle: str) -> str:
    """``zmq_handle`` when it is an ``ipc://`` path inside :func:`private_socket_dir`; WeightSyncError otherwise (the
    stream is unpickled: see the module docstring)."""
    if not isinstance(zmq_handle, str) or not zmq_handle.startswith("ipc://"):
        raise WeightSyncError(f"ZMQ weight stream: {zmq_handle!r} is not an ipc:// path; the stream is pickled, so "
                              f"only a socket in this user's private directory {private_socket_dir()} is accepted "
                              f"(never a TCP port)")
    folder = os.path.dirname(os.path.realpath(zmq_handle[len("ipc://"):]))
    if folder != os.path.realpath(private_socket_dir()):
        raise WeightSyncError(f"ZMQ weight stream: {zmq_handle!r} is outside this user's private socket directory "
                              f"{private_socket_dir()} (mode 0700); the stream is pickled, so no other path is "
                              f"accepted")
    return zmq_handle


def _recv(socket, timeout_s: float, what: str):
    if not socket.poll(int(timeout_s * 1000)):
        raise WeightSyncError(f"ZMQ weight stream: no {what} from the sender within {timeout_s:g}s")
    return pickle.loads(socket.recv())


def _open_shm(meta) -> tuple[mmap.mmap, torch.Tensor]:
    if not (isinstance(meta, dict) and isinstance(meta.get("name"), str) and isinstance(meta.get("size"), int)):
        raise WeightSyncError(f"ZMQ weight stream: use_shm=True expects {{'name', 'size'}} for the buffer, got "
                              f"{type(meta).__name__}")
    name = meta["name"].lstrip("/")
    if "/" in name or not name:
        raise WeightSyncError(f"ZMQ weight stream: bad shared-memory name {meta['name']!r}")
    # mapped directly (not multiprocessing.shared_memory): the sender owns and unlinks the segment; Python's resource
    # tracker would otherwise unlink it, or warn, when this process exits
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, int(meta["size"]), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _close(mm: Optional[mmap.mmap]) -> None:
    if mm is not None:
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the last one
            pass


def _read_bucket(buffer: torch.Tensor, bucket_meta: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, m in bucket_meta.items():
        if m.get("handle") is not None:
            raise WeightSyncError(f"ZMQ weight stream: tensor {name!r} came as a CUDA-IPC handle; omniroll reads "
                                  f"shared memory only (use_shm=True)")
        dtype, shape, offset = m["dtype"], torch.Size(m["shape"]), int(m["offset"])
        nbytes = dtype.itemsize * shape.numel()
        if offset < 0 or offset + nbytes > buffer.numel():
            raise WeightSyncError(f"ZMQ weight stream: tensor {name!r} ({offset}+{nbytes} bytes) lies outside the "
                                  f"{buffer.numel()}-byte buffer")
        # cloned: the sender refills the buffer as soon as this bucket is answered
        out.append((str(name), buffer[offset:offset + nbytes].view(dtype).view(shape).clone()))
    return out


def receive_zmq_stream(zmq_handle: str, use_shm: bool, timeout_s: float = 600.0
                       ) -> list[tuple[str, torch.Tensor]]:
    """Receive one verl bucketed stream from the sender bound at ``zmq_handle``; returns ``(name, tensor)`` pairs in
    the order sent (host tensors, owned by the caller). Raises :class:`WeightSyncError` after draining the stream
    when it cannot be read (see the module docstring)."""
    import zmq

    check_socket_handle(zmq_handle)
    socket = zmq.Context.instance().socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(zmq_handle)
    named: list[tuple[str, torch.Tensor]] = []
    error: Optional[BaseException] = None
    mm, buffer = None, None
    try:
        comm = _recv(socket, timeout_s, "buffer description")
        try:
            if not use_shm:
                raise WeightSyncError("ZMQ weight stream: use_shm=False (a CUDA-IPC buffer) is not supported by "
                                      "omniroll's receiver; send with use_shm=True (OmnirollServerAdapter.use_shm)")
            mm, buffer = _open_shm(comm)
        except (WeightSyncError, OSError, ValueError) as e:
            error = e
        socket.send(b"")
        while True:
            msg = _recv(socket, timeout_s, "bucket")
            is_last = bool(msg.get("is_last")) if isinstance(msg, dict) else True
            if error is None:
                try:
                    if not isinstance(msg, dict) or not isinstance(msg.get("bucket_meta"), dict):
                        raise WeightSyncError(f"ZMQ weight stream: expected {{'bucket_meta', 'is_last'}}, got "
                                              f"{type(msg).__name__}")
                    named.extend(_read_bucket(buffer, msg["bucket_meta"]))
                except (WeightSyncError, KeyError, TypeError, ValueError, RuntimeError) as e:
                    error = e
            if is_last:
                break
            socket.send(b"")
        buffer = None
        mm = _close(mm)
        socket.send(b"")  # the last answer, after the buffer was released (as verl's receiver does)
    finally:
        buffer = None
        _close(mm)
        socket.close()
    if error is not None:
        raise error if isinstance(error, WeightSyncError) else WeightSyncError(f"ZMQ weight stream: {error}")
    return named
