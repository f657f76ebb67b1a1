"""`RunResume`: a run started again from one of its checkpoints: the checkpoint found before anything starts, its
state loaded into the trainer's fresh parts, the batches that were in flight at it generated again once the replicas
run, and the check that the first `train(steps)` is the one those batches fit.

    resume = RunResume("out/run")                       # FileNotFoundError naming --resume, before Ray starts
    resume.load(tc, policy, algorithm, optimizer, store, log)   # resume.step, .tracking, .sharded_optimizer, ...
    resume.regenerate(pipeline, tc, sync, store, version, log)  # after the replicas started
    resume.check_steps(last, tc)                        # the first train() call
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from omniroll.train import checkpoint
from omniroll.train.async_rollout import regenerate_in_flight


class RunResume:
    """path: a run directory or one of its checkpoint directories (`checkpoint.find_checkpoint`)."""

    def __init__(self, path: str):
        self.path = checkpoint.find_checkpoint(path)
        self.step = 0  # the checkpoint's last completed step (after `load`)
        self.discarded_samples = 0  # in-flight samples discarded at the Ctrl-C that wrote it
        self.tracking: Optional[dict] = None  # the trackers' run ids
        self.sharded_optimizer: Optional[str] = None  # an fsdp run's optimizer directory (the ranks load it)
        self.controls: Optional[dict] = None  # the reward controls' state (train/reward_controls.py)
        self.in_flight_to: Optional[int] = None  # the regenerated in-flight batches end here (until checked)

    def load(self, tc: Any, policy: Any, algorithm: Any, optimizer: Any, store: Any,
             log: Callable[[str], None]) -> None:
        """The checkpoint into the trainer's parts (`checkpoint.restore`: mode, algorithm and sharding checked)."""
        got = checkpoint.restore(self.path, tc, policy, algorithm, optimizer, store)
        self.step, self.discarded_samples = got.step, got.discarded_samples
        self.tracking, self.sharded_optimizer = got.tracking, got.sharded_optimizer
        self.controls = got.controls  # the trainer loads it into its RewardControls
        log(f"resumed from {self.path} (step {self.step})")

    def regenerate(self, pipeline: Any, tc: Any, sync: Callable[[int], None], store: Any, version: int,
                   log: Callable[[str], None]) -> None:
        """The batches in flight at the checkpoint, submitted as the straight run generated them, up to
        `trainer.steps` (`async_rollout.regenerate_in_flight`); the replicas end at the checkpoint's version."""
        if self.step == 0:
            return
        regenerate_in_flight(pipeline, self.step, tc.max_staleness, tc.steps, sync, store.has, version, log)
        if tc.max_staleness:
            self.in_flight_to = min(self.step + tc.max_staleness, tc.steps)

    def check_steps(self, last: int, tc: Any) -> None:
        """The first `train(steps=last)` after the resume: ValueError when `last` needs other in-flight batches than
        `regenerate` submitted (before any step)."""
        if self.in_flight_to is None:
            return
        if min(self.step + tc.max_staleness, last) != self.in_flight_to:
            raise ValueError(f"train(steps={last}) after a resume with trainer.max_staleness {tc.max_staleness}: "
                             f"start() regenerated the in-flight batches up to trainer.steps {tc.steps}; set "
                             f"trainer.steps={last} in the config instead")
        self.in_flight_to = None
