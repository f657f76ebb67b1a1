"""The engine's row threads: a step's rows, and a decode's blocks, shared among threads that each run one torch thread.

`EngineConfig.row_threads` = n > 1 splits every denoising step's rows into (at most) n forwards of about equal rows,
run at once on n threads, and decodes a call's VAE blocks on them too. Each thread runs torch at one intra-op
thread, so the process's cores work on separate forwards instead of splitting every op among themselves. On a
small model's many small ops this scales better than intra-op threads (measured on 2 cores, the shipped shapes
model, 96 CFG rows a step: two forwards of 48 rows at once took 0.79x the time of one forward of 96 on 2 intra-op
threads; docs/benchmarks.md).

In batch-invariant mode a row's result does not depend on what shares its forward, and every thread runs the
kernels of one torch thread, so a sample has the bits of an engine at `num_threads` 1 (tested), whatever n is. Grad
mode and torch function modes are per thread: each call below enters what it needs on the thread that runs it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def _one_torch_thread() -> None:
    torch.set_num_threads(1)  # this thread's OpenMP threads (and the process's setting, already 1 in this mode)


class RowThreads:
    """`n` threads, each at one torch thread: `spans` cuts a step's rows into contiguous shares, `map` runs a call on
    each share (or block) at once and returns the results in order."""

    def __init__(self, n: int):
        if n < 2:
            raise ValueError(f"row_threads must be >= 2 for a RowThreads, got {n}")
        self.n = n
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="omniroll-rows", initializer=_one_torch_thread)

    def spans(self, rows: Sequence[int]) -> list[tuple[int, int]]:
        """Contiguous (start, end) ranges of the requests whose forward rows are `rows`, at most `n` of them, each
        holding about the same number of rows (a request's rows are never split: a CFG request's two stay
        together). Ranges are never empty."""
        total = sum(rows)
        spans, start, acc = [], 0, 0
        for i, r in enumerate(rows):
            acc += r
            left = len(rows) - i - 1
            if len(spans) < self.n - 1 and left and acc * self.n >= total * (len(spans) + 1):
                spans.append((start, i + 1))
                start = i + 1
        spans.append((start, len(rows)))
        return spans

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """`fn(item)` for every item, on the threads at once (a single item too: never on the caller's thread, whose
        torch threads may differ); the results in order (the first error raises)."""
        return list(self._pool.map(fn, items))

    def shutdown(self) -> None:
        """Stop the threads (called once nothing runs on them: they exit at once)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
