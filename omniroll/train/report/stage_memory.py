"""Peak device memory per stage of a training step (`StageMemory`): `peak_mem_<stage>_gb` in the step's record, for
the stages rollout (the replicas' own peak, read from them), recompute (the trainer's passes before its first
optimizer update: the algorithm's anchors, the policy-move snapshot), update (the inner epochs; with data-parallel
ranks, the largest rank's) and sync (the weight push). Only a device that reports memory (CUDA) gives them; on the
CPU the record has none.

    mem = StageMemory("cuda:0", replicas_on="cuda")
    mem.add_replicas(replicas)          # rollout: each replica's peak since its last reading
    mem.begin()
    ...the anchors...
    mem.end("recompute")                # this process's peak since begin (or the last end); a new one starts
    ...the update...
    mem.end("update")
    record.update(mem.metrics())        # {"peak_mem_rollout_gb": ..., "peak_mem_recompute_gb": ..., ...}

Out of device memory in the trainer's process: `naming_oom` re-raises torch's error as `StageOutOfMemory`, one line
naming the stage that ran out and the keys that lower it (docs/troubleshooting.md, "Out of memory").
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from omniroll.engine.memory import peak_bytes

STAGES = ("rollout", "recompute", "update", "sync")
#: what lowers each stage's memory (docs/troubleshooting.md's table, in one line each)
KNOBS = {
    "rollout": "lower engine.max_batch_size (or auto), fewer replicas per GPU (replicas.num_gpus), or "
               "replicas.colocate with replicas.sleep_level 2",
    "recompute": "lower trainer.micro_batch_size or trainer.policy_move_rows",
    "update": "lower trainer.micro_batch_size, keep trainer.gradient_checkpointing on, trainer.mode lora, "
              "trainer.sharding fsdp (full fine-tuning on world_size > 1), or replicas.colocate (the replicas "
              "sleep during the update)",
    "sync": "engine.kwargs.weight_update in_place (no staging copy), or trainer.mode lora",
}


class StageOutOfMemory(RuntimeError):
    """The device ran out of memory in a stage of a training step (the message names it and what to change)."""


class StageMemory:
    """device: the trainer's; replicas_on: the replicas' (engine.device)."""

    def __init__(self, device: str | torch.device, replicas_on: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.reports = self.device.type == "cuda"
        self.replicas_report = torch.device(replicas_on).type == "cuda"
        self.peaks: dict[str, int] = {}
        self.current = "recompute"  # the trainer's stage in progress (what an out-of-memory error is named after)

    def begin(self) -> None:
        """A new peak of this process starts."""
        if self.reports:
            peak_bytes(self.device)

    def end(self, stage: str) -> None:
        """This process's peak since `begin` (or the last `end`) is stage `stage`'s; a new one starts (the next
        stage's)."""
        if self.reports:
            self.add(stage, peak_bytes(self.device))
        self.current = STAGES[STAGES.index(stage) % (len(STAGES) - 1) + 1]

    @contextlib.contextmanager
    def naming_oom(self) -> Iterator[None]:
        """torch's out-of-memory error inside the block becomes `StageOutOfMemory`, naming the stage in progress."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            first = (str(e).strip().splitlines() or ["out of memory"])[0]
            raise StageOutOfMemory(f"out of memory on {self.device} during the {self.current} stage: "
                                   f"{KNOBS[self.current]} (docs/troubleshooting.md, Out of memory; torch: {first})"
                                   ) from e

    def add(self, stage: str, peak: Optional[int]) -> None:
        """A peak measured in another process (a rank): the largest one counts."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if peak is not None:
            self.peaks[stage] = max(self.peaks.get(stage, 0), int(peak))

    def add_replicas(self, replicas: list) -> None:
        """The rollout stage: every replica's peak since its last reading (`RolloutReplica.memory`)."""
        if self.replicas_report:
            import ray

            for m in ray.get([r.memory.remote() for r in replicas]):
                self.add("rollout", m["peak_bytes"])

    def metrics(self) -> dict:
        """The step's `peak_mem_<stage>_gb` (GiB), in stage order; then a new step starts."""
        out = {f"peak_mem_{s}_gb": self.peaks[s] / 2**30 for s in STAGES if s in self.peaks}
        self.peaks, self.current = {}, "recompute"
        return out
