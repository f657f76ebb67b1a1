"""Forward rows by measurement (`max_batch_size="auto"`): the engine picks, per batch key, the rows per forward with
the lowest measured cost per row.

On a CPU a forward costs about the same per row from 8 to 32 rows (cache effects make the smallest sizes a bit
cheaper per row, per-forward overheads the largest); on a GPU the cost per row falls until the device is saturated.
No fixed number is right for every model, shape and machine, so the first request of a batch key triggers a short
calibration: a forward at each candidate row count (one warm-up, then `repeats` timed runs interleaved across the
candidates, the minimum kept: noise only ever adds time), in the engine's execution mode (batch-invariant or not).
A candidate replaces the CPU rule's 16 rows only when it is at least `MIN_GAIN` cheaper per row (timing noise must
not move the choice). The choice is cached in memory and on disk (`$OMNIROLL_CACHE_DIR/calibration.json`, default
`~/.cache/omniroll`), keyed by the denoiser's architecture, latent shape, text length, thread count, device, dtype
and mode, so a machine calibrates each shape once; a calibration made while the machine is busy (1-minute load
average above the CPU count) is used by this process only, never cached on disk. The rows never change a sample in
batch-invariant mode (tested), so replicas that calibrate differently still give bitwise-identical samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from omniroll.engine.request import RequestState
from omniroll.files import cache_dir

log = logging.getLogger(__name__)

CPU_CANDIDATES = (4, 8, 16, 32)
GPU_CANDIDATES = (8, 16, 32, 64, 128)
FALLBACK_ROWS = 16  # the CPU rule; also used when a calibration cannot run (logged)
MIN_GAIN = 0.05  # another row count must be this much cheaper per row than FALLBACK_ROWS to replace it

_memory: dict[str, int] = {}
_lock = threading.Lock()


def cache_path() -> Path:
    return Path(cache_dir()) / "calibration.json"


def _read_disk() -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(cache_path().read_text())
    return {}


def _write_disk(key: str, rows: int) -> None:
    """Merge one entry into the cache file (atomic replace; a failure only costs a later re-calibration)."""
    path = cache_path()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_disk()
        data[key] = rows
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _machine_busy() -> bool:
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    return False


class RowCalibrator:
    """`max_batch_size_for(state)`: forward rows for the batch key of `state` (measured once per key and machine)."""

    def __init__(self, adapter, execution_mode: Callable, device: str, dtype: torch.dtype, invariant: bool,
                 repeats: int = 2):
        self.adapter = adapter
        self.execution_mode = execution_mode
        self.device = torch.device(device)
        self.dtype = dtype
        self.invariant = invariant
        self.repeats = repeats
        self.candidates = GPU_CANDIDATES if self.device.type == "cuda" else CPU_CANDIDATES
        self.measured: dict[str, dict[int, float]] = {}  # key -> ms per row (the calibrations this engine ran)

    def cache_key(self, state: RequestState) -> str:
        den = self.adapter.denoiser
        arch = json.dumps(dict(getattr(den, "config", {})), sort_keys=True, default=str)
        cpu = platform.processor() or platform.machine()
        ident = (f"{type(den).__name__}|{hashlib.sha256(arch.encode()).hexdigest()[:16]}|"
                 f"{state.latent_shape}|L{state.params.max_sequence_length}|expert{state.expert}|threads{torch.get_num_threads()}|"
                 f"{self.device.type}|{self.dtype}|{'invariant' if self.invariant else 'plain'}|{cpu}|"
                 f"torch{torch.__version__}|{'|'.join(map(str, self.candidates))}")
        return ident

    def max_batch_size_for(self, state: RequestState) -> int:
        key = self.cache_key(state)
        with _lock:
            if key in _memory:
                return _memory[key]
            disk = _read_disk()
            if isinstance(disk.get(key), int):
                _memory[key] = disk[key]
                return disk[key]
        try:
            rows = self._measure(key, state)
        except Exception as e:  # noqa: BLE001 - a calibration never fails a request; it falls back and says so
            log.warning("forward-row calibration failed (%r); using %d rows", e, FALLBACK_ROWS)
            return FALLBACK_ROWS
        with _lock:
            _memory[key] = rows
            if not _machine_busy():
                _write_disk(key, rows)
        return rows

    @torch.no_grad()
    def _measure(self, key: str, state: RequestState) -> int:
        cond = self.adapter.encode_prompts([""], state.params.max_sequence_length)[0]
        n = max(self.candidates)
        x = torch.randn((n,) + state.latent_shape, generator=torch.Generator().manual_seed(0)).to(self.device)
        t = torch.full((n,), 500.0, device=self.device)
        tensors = {k: v.unsqueeze(0).expand(n, *v.shape).contiguous().to(self.device) for k, v in cond.tensors.items()}
        guidance = None
        if getattr(self.adapter, "guidance_kind", None) == "distilled":
            guidance = torch.full((n,), 3.5, device=self.device)
        times = {r: float("inf") for r in self.candidates}

        def forward(rows):
            with self.execution_mode():
                self.adapter.velocity(x[:rows], t[:rows], {k: v[:rows] for k, v in tensors.items()},
                                      guidance=None if guidance is None else guidance[:rows], expert=state.expert)
            if self.device.type == "cuda":
                torch.cuda.synchronize()

        for rows in self.candidates:
            forward(rows)  # warm-up
        for rep in range(self.repeats):
            for rows in (self.candidates if rep % 2 == 0 else tuple(reversed(self.candidates))):
                t0 = time.perf_counter()
                forward(rows)
                times[rows] = min(times[rows], (time.perf_counter() - t0) * 1000 / rows)
        self.measured[key] = times
        best = min(self.candidates, key=lambda r: times[r])
        if FALLBACK_ROWS in times and times[best] > (1 - MIN_GAIN) * times[FALLBACK_ROWS]:
            best = FALLBACK_ROWS
        log.info("forward rows for %s: %d (ms per row %s)", key, best, {r: round(v, 2) for r, v in times.items()})
        return best
