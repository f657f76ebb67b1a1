"""Replicas that share the trainer's device (`replicas.colocate`; docs/training/gpu.md): put to sleep before each
update, woken before the weight sync (a sleeping engine refuses weight updates, so the sync lands on the woken one).

    colo = Colocation(level=1, timeout_s=600)
    colo.check(replicas, trainer_device)      # at start: every replica on the trainer's physical device
    sleep_s = colo.sleep(replicas)            # level 1: weights to host memory; 2: the denoiser's weights dropped
    ...the update...
    wake_s = colo.wake(replicas)              # weights back (after level 2: fresh storage the full sync fills)

Sleep and wake are the engine's (`DiffusionEngine.sleep` / `wake_up`): an error (out of memory in wake_up, say) or
a timeout reaches the trainer, nothing hangs. The synchronous trainer rolls nothing out during the update
(`replicas.colocate` needs `trainer.max_staleness` 0), so the sleep aborts nothing.
"""

from __future__ import annotations

import time

from omniroll.engine.memory import device_identity


class ColocationError(RuntimeError):
    """A colocated replica is not on the trainer's device, or did not sleep or wake."""


class Colocation:
    def __init__(self, level: int, timeout_s: float):
        self.level, self.timeout_s = int(level), float(timeout_s)

    def check(self, replicas: list, device: str) -> None:
        """Every replica runs on the trainer's physical device (its GPU's UUID: the device index alone says nothing
        across processes); ColocationError naming `replicas.colocate` otherwise."""
        import ray

        own = device_identity(device)
        found = [m["device"] for m in ray.get([r.memory.remote() for r in replicas])]
        away = [f"replica {i}: {d}" for i, d in enumerate(found) if d != own]
        if away:
            raise ColocationError(f"replicas.colocate: the trainer computes on {device} ({own}), but "
                                  f"{'; '.join(away)}; place them on one device (engine.device, replicas.num_gpus, "
                                  f"trainer.device)")

    def sleep(self, replicas: list) -> float:
        """Every replica asleep at `level`; returns the seconds it took."""
        return self._all(replicas, "sleep", level=self.level, timeout_s=self.timeout_s)

    def wake(self, replicas: list) -> float:
        """Every replica awake; returns the seconds it took."""
        return self._all(replicas, "wake_up", timeout_s=self.timeout_s)

    def _all(self, replicas: list, call: str, **kw) -> float:
        import ray

        t0 = time.perf_counter()
        try:
            ray.get([getattr(r, call).remote(**kw) for r in replicas], timeout=self.timeout_s + 30)
        except Exception as e:  # noqa: BLE001 - the engine's own error (e.g. out of memory in wake_up), named
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ColocationError(f"replicas.colocate: {call} of the colocated replicas failed: "
                                  f"{type(e).__name__}: {first}") from e
        return time.perf_counter() - t0
