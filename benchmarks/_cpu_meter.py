"""CPU accounting for benchmarks/agent_loop_overhead.py: CPU seconds per process of this process tree, by role."""

from __future__ import annotations

import collections
import contextlib
import os


class CpuMeter:
    """CPU seconds (user + system) per process of this process tree (driver, Ray daemons, Ray workers), grouped by
    role. Other tenants of a shared machine are not in the tree and not counted."""

    def __init__(self, roles: dict[int, str]):
        import psutil

        self.psutil = psutil
        self.roles = dict(roles)  # pid -> role; everything else in the tree is "ray other"
        self.roles.setdefault(os.getpid(), "driver")

    def _procs(self):
        me = self.psutil.Process()
        with contextlib.suppress(self.psutil.Error):
            yield me
            yield from me.children(recursive=True)

    def snapshot(self) -> dict[int, float]:
        snap = {}
        for p in self._procs():
            with contextlib.suppress(self.psutil.Error):
                t = p.cpu_times()
                snap[p.pid] = t.user + t.system
        return snap

    def delta(self, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for pid, t in after.items():
            out[self.roles.get(pid, "ray other")] += t - before.get(pid, 0.0)
        return dict(out)
