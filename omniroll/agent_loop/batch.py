"""`DataBatch`: a minimal container compatible with verl's `DataProto`.

Same three parts and names (`batch`: a TensorDict with batch_size [B]; `non_tensor_batch`: str -> numpy object array
of length B; `meta_info`: dict) and the same method names, so the verl integration converts with
`DataProto(batch=db.batch, non_tensor_batch=db.non_tensor_batch, meta_info=db.meta_info)`.
Differences from DataProto: `chunk` allows uneven chunks (sizes differ by at most one), and `concat` merges
`meta_info` strictly (equal values or an error naming the key; `metrics` lists are concatenated).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict


def to_object_array(values: Iterable[Any]) -> np.ndarray:
    """A 1-D object array, even when the values are lists or dicts (np.array would build a 2-D array)."""
    values = list(values)
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def prompt_batch(prompts: Sequence[str], n: int, uid_of: Callable[[int], str], *, data_source: str,
                 indices: Optional[Sequence[int]] = None, meta_info: Optional[dict] = None) -> "DataBatch":
    """The agent loop's input batch: `n` rows for each prompt, grouped (p, p, ..., q, q, ...), with `raw_prompt`,
    `uid`, `_group_index` (0..n-1 within the group), `data_source` and `extra_info` ({}).

    `indices` picks the prompts (positions in `prompts`, default all, in order). The uid rule is the caller's and
    explicit: row group i gets `uid_of(i)` of its prompt's position i in `prompts` (the CLI and `/v1/rollout`:
    `batch_prompt_uid(i)`, the command-line position; the trainer: the same function of the index in its prompt
    list; validation: `val{i:04d}`), and the uid with the row's group index seeds the sample."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    indices = range(len(prompts)) if indices is None else indices
    rows = [(i, j) for i in indices for j in range(n)]
    return DataBatch.from_dict(non_tensors={
        "raw_prompt": [prompts[i] for i, _ in rows], "uid": [uid_of(i) for i, _ in rows],
        "_group_index": [j for _, j in rows], "data_source": [data_source] * len(rows),
        "extra_info": [{} for _ in rows]}, meta_info=dict(meta_info or {}))


def command_batch(prompts: Sequence[str], n: int, rollout_seed: Optional[int] = None,
                  validate: bool = False) -> "DataBatch":
    """A command's input batch (`omniroll generate`, `omniroll rollout`, `run_rollout`): `n` rows per prompt (p0, p0,
    ..., p1, ...), uid = `batch_prompt_uid(position)`, seeded at `CLI_GLOBAL_STEP`."""
    from omniroll.sampling.seeds import CLI_GLOBAL_STEP, batch_prompt_uid

    if not prompts:
        raise ValueError("prompts must not be empty")
    meta = {"global_steps": CLI_GLOBAL_STEP, "validate": validate}
    if rollout_seed is not None:
        meta["rollout_seed"] = rollout_seed
    return prompt_batch(prompts, n, batch_prompt_uid, data_source="cli", meta_info=meta)


class DataBatch:
    def __init__(
        self,
        batch: Optional[TensorDict] = None,
        non_tensor_batch: Optional[dict[str, np.ndarray]] = None,
        meta_info: Optional[dict] = None,
        batch_size: Optional[int] = None,
    ):
        nt = {k: (v if isinstance(v, np.ndarray) and v.dtype == object and v.ndim == 1 else to_object_array(v))
              for k, v in (non_tensor_batch or {}).items()}
        if batch is None:
            if batch_size is None:
                batch_size = len(next(iter(nt.values()))) if nt else 0
            batch = TensorDict({}, batch_size=[batch_size])
        self.batch = batch
        self.non_tensor_batch = nt
        self.meta_info = dict(meta_info or {})
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: Optional[dict[str, torch.Tensor]] = None,
        non_tensors: Optional[dict[str, Any]] = None,
        meta_info: Optional[dict] = None,
    ) -> "DataBatch":
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        sizes = {k: int(v.shape[0]) for k, v in tensors.items()}
        sizes.update({k: len(v) for k, v in non_tensors.items()})
        if not sizes:
            raise ValueError("DataBatch.from_dict needs at least one tensor or non-tensor field")
        if len(set(sizes.values())) != 1:
            raise ValueError(f"DataBatch.from_dict: fields have different batch sizes: {sizes}")
        b = next(iter(sizes.values()))
        td = TensorDict(tensors, batch_size=[b])
        return cls(td, {k: to_object_array(v) for k, v in non_tensors.items()}, meta_info, batch_size=b)

    def check_consistency(self) -> None:
        if len(self.batch.batch_size) != 1:
            raise ValueError(f"DataBatch.batch must have exactly one batch dimension, got {self.batch.batch_size}")
        b = int(self.batch.batch_size[0])
        for k, v in self.non_tensor_batch.items():
            if not isinstance(v, np.ndarray) or v.dtype != object or v.ndim != 1:
                raise ValueError(f"non_tensor_batch[{k!r}] must be a 1-D numpy object array")
            if len(v) != b:
                raise ValueError(f"non_tensor_batch[{k!r}] has length {len(v)}, expected the batch size {b}")

    def __reduce__(self):
        """Pickled (e.g. between Ray actors) with its tensors as numpy arrays, which Ray moves far more cheaply than
        pickled torch tensors; bf16 travels as its bits and comes back bit-exact."""
        from omniroll.rollout.wire import tensor_to_numpy

        if not all(isinstance(v, torch.Tensor) for v in self.batch.values()):  # nested TensorDicts: plain pickling
            return (DataBatch, (self.batch, self.non_tensor_batch, self.meta_info, len(self)))
        arrays = {k: tensor_to_numpy(v) for k, v in self.batch.items()}
        return (_rebuild, (arrays, self.non_tensor_batch, self.meta_info, len(self)))

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    def __getitem__(self, idx) -> "DataBatch":
        """Rows by slice, list / array of ints, or boolean mask (an int gives a one-row DataBatch)."""
        if isinstance(idx, (int, np.integer)):
            idx = [int(idx)]
        if isinstance(idx, slice):
            rows = np.arange(len(self))[idx]
        else:
            rows = np.asarray(idx)
            if rows.dtype == bool:
                rows = np.nonzero(rows)[0]
        rows = rows.astype(np.int64)
        td = self.batch[torch.as_tensor(rows)] if len(self.batch.keys()) else TensorDict({}, batch_size=[len(rows)])
        return DataBatch(td, {k: v[rows] for k, v in self.non_tensor_batch.items()}, self.meta_info, len(rows))

    def select(
        self,
        batch_keys: Optional[Sequence[str]] = None,
        non_tensor_batch_keys: Optional[Sequence[str]] = None,
        meta_info_keys: Optional[Sequence[str]] = None,
        deepcopy: bool = False,
    ) -> "DataBatch":
        for name, keys, have in (("batch", batch_keys, self.batch.keys()),
                                 ("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch.keys()),
                                 ("meta_info", meta_info_keys, self.meta_info.keys())):
            missing = [k for k in (keys or ()) if k not in have]
            if missing:
                raise KeyError(f"select: {name} has no key(s) {missing}; available: {sorted(have)}")
        td = self.batch.select(*batch_keys) if batch_keys is not None else self.batch
        nt = ({k: self.non_tensor_batch[k] for k in non_tensor_batch_keys}
              if non_tensor_batch_keys is not None else dict(self.non_tensor_batch))
        mi = {k: self.meta_info[k] for k in meta_info_keys} if meta_info_keys is not None else dict(self.meta_info)
        if deepcopy:
            td, nt, mi = td.clone(), copy.deepcopy(nt), copy.deepcopy(mi)
        return DataBatch(td, nt, mi, len(self))

    def pop(self, batch_keys=(), non_tensor_batch_keys=(), meta_info_keys=()) -> "DataBatch":
        td = TensorDict({k: self.batch.pop(k) for k in batch_keys}, batch_size=[len(self)])
        nt = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        mi = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataBatch(td, nt, mi, len(self))

    def union(self, other: "DataBatch") -> "DataBatch":
        """Add `other`'s fields (same batch size); shared keys must be equal."""
        if len(other) != len(self):
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        for k in other.batch.keys():
            if k in self.batch.keys() and not torch.equal(self.batch[k], other.batch[k]):
                raise ValueError(f"union: tensor {k!r} differs")
            self.batch[k] = other.batch[k]
        for k, v in other.non_tensor_batch.items():
            if k in self.non_tensor_batch and list(self.non_tensor_batch[k]) != list(v):
                raise ValueError(f"union: non-tensor {k!r} differs")
            self.non_tensor_batch[k] = v
        for k, v in other.meta_info.items():
            if k in self.meta_info and self.meta_info[k] != v:
                raise ValueError(f"union: meta_info {k!r} differs")
            self.meta_info[k] = v
        return self

    # ------------------------------------------------------------------ split / merge
    def split(self, sizes: int | Sequence[int]) -> list["DataBatch"]:
        """`split(k)`: chunks of k rows (the last may be shorter); `split([s0, s1, ...])`: exactly those sizes."""
        n = len(self)
        if isinstance(sizes, (int, np.integer)):
            if sizes < 1:
                raise ValueError(f"split size must be >= 1, got {sizes}")
            sizes = [min(int(sizes), n - s) for s in range(0, n, int(sizes))]
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to the batch size {n}")
        out, start = [], 0
        for s in sizes:
            out.append(self[start:start + s])
            start += s
        return out

    def chunk(self, chunks: int) -> list["DataBatch"]:
        """`chunks` consecutive pieces whose sizes differ by at most one (5 rows over 2 -> 3 + 2)."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        n = len(self)
        base, extra = divmod(n, chunks)
        return self.split([base + (1 if i < extra else 0) for i in range(chunks)])

    @staticmethod
    def concat(data: Sequence["DataBatch"]) -> "DataBatch":
        data = list(data)
        if not data:
            raise ValueError("concat needs at least one DataBatch")
        keys = set(data[0].batch.keys())
        for i, d in enumerate(data):
            if set(d.batch.keys()) != keys and len(d):
                raise ValueError(f"concat: part {i} has tensor keys {sorted(d.batch.keys())}, part 0 {sorted(keys)}")
        parts = [d for d in data if len(d)] or data[:1]
        td = torch.cat([d.batch for d in parts]) if keys else TensorDict({}, batch_size=[sum(map(len, data))])
        nt_keys = set(parts[0].non_tensor_batch)
        for i, d in enumerate(parts):
            if set(d.non_tensor_batch) != nt_keys:
                raise ValueError(f"concat: part {i} has non-tensor keys {sorted(d.non_tensor_batch)}, "
                                 f"expected {sorted(nt_keys)}")
        nt = {k: np.concatenate([d.non_tensor_batch[k] for d in parts]) for k in nt_keys}
        meta: dict = {}
        for d in data:
            for k, v in d.meta_info.items():
                if k == "metrics" and isinstance(v, list):
                    meta.setdefault(k, []).extend(v)
                elif k in meta and not _equal(meta[k], v):
                    raise ValueError(f"concat: meta_info[{k!r}] differs between parts ({meta[k]!r} vs {v!r})")
                else:
                    meta[k] = v
        return DataBatch(td, nt, meta, int(td.batch_size[0]))

    def repeat(self, repeat_times: int, interleave: bool = True) -> "DataBatch":
        idx = np.arange(len(self))
        idx = np.repeat(idx, repeat_times) if interleave else np.tile(idx, repeat_times)
        return self[idx]

    def __repr__(self) -> str:
        tensors = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in self.batch.items()}
        return (f"DataBatch(len={len(self)}, batch={tensors}, non_tensor_batch={sorted(self.non_tensor_batch)}, "
                f"meta_info={sorted(self.meta_info)})")


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _rebuild(arrays: dict, non_tensor_batch: dict, meta_info: dict, batch_size: int) -> DataBatch:
    from omniroll.rollout.wire import numpy_to_tensor

    td = TensorDict({k: numpy_to_tensor(a) for k, a in arrays.items()}, batch_size=[batch_size])
    return DataBatch(td, non_tensor_batch, meta_info, batch_size=batch_size)
