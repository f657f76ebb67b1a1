"""`start_updater`: who runs the step's update, chosen once at start: this process (`LocalUpdate`,
`trainer.world_size: 1`) or the data-parallel ranks (`RankGroup`, world_size > 1); and `driver_device`, where the
trainer's own process holds the policy. Both updaters take the same calls, so the trainer never branches on which it
holds:

    result = updater.update(rows, advantages, uids, plan)  # an UpdateResult; the driver's policy and algorithm hold
                                                           # the trained weights and state after it
    state, files = updater.optimizer_state(step)           # what the checkpoint of completed step `step` saves
    updater.close()
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from omniroll.config.device import trainer_device
from omniroll.train.local_update import LocalUpdate
from omniroll.train.parallel.distributed import RankGroup


def driver_device(config) -> str:
    """The device of the trainer's own policy: `trainer.device` (else `engine.device`) when it trains in this process;
    the CPU when ranks train (each on its own device: omniroll/train/parallel/rank.py)."""
    return trainer_device(config) if config.trainer.world_size == 1 else "cpu"


def start_updater(config, model_path: str, out_dir: str, log: Callable[[str], None], *, policy, optimizer,
                  algorithm, store, memory, sharded_optimizer: Optional[str] = None) -> LocalUpdate | RankGroup:
    """The updater of `config.trainer.world_size` (module doc), started: the ranks get the trainer's weights,
    optimizer state (`optimizer`'s, or the directory of a resumed fsdp run's: `sharded_optimizer`), algorithm state
    and kept versions, and write their optimizer state under `out_dir`/rank_state. `memory`: the trainer's
    `StageMemory` (the ranks measure their own peaks)."""
    if config.trainer.world_size > 1:
        group = RankGroup(config, model_path, os.path.join(out_dir, "rank_state"), log)
        return group.start(policy, optimizer, algorithm, store, sharded_optimizer)
    return LocalUpdate(policy, optimizer, algorithm, config.trainer, memory)
