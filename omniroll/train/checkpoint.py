"""A training run's checkpoints: `checkpoints/step_NNNNNN/` with the trained weights (`Policy.save`), the kept
versions (`VersionStore.save`), and `trainer_state.pt` (step, version, optimizer, the algorithm's own state such as
NFT's old weights, the config, the trackers' run ids: `run_state`), plus `checkpoints/latest`; finding one
(`find_checkpoint`), reading its state without unpickling code (`read_trainer_state`) and loading it into a trainer's
parts (`restore`). With `trainer.sharding: fsdp` the optimizer state
is a torch.distributed.checkpoint directory `optimizer/` beside it (each rank's shard, written by the ranks), and
trainer_state.pt's "optimizer" is {"sharded": "optimizer"}.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import torch

from omniroll.files import staged_directory


def write_checkpoint(out_dir: str, step: int, *, policy, store, state: dict, files: Optional[dict] = None) -> str:
    """Write step `step`'s checkpoint (`state`: the trainer_state.pt dict; `files`: name -> a file or directory put
    beside it, hard-linked where it can) and point `latest` at it. The checkpoint is written into a temporary
    directory and renamed into place, replacing a directory of the same step whole (say, of an earlier run in the
    same `--out`): a checkpoint never mixes files of two runs, and `latest` never names a half-written one."""
    root = os.path.join(out_dir, "checkpoints")
    path = os.path.join(root, f"step_{step:06d}")
    with staged_directory(path) as tmp:
        policy.save(tmp)
        store.save(tmp)
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        for name, src in (files or {}).items():
            link_or_copy(src, os.path.join(tmp, name))
    latest = os.path.join(root, "latest")
    with open(latest + ".tmp", "w") as f:
        f.write(os.path.basename(path) + "\n")
    os.replace(latest + ".tmp", latest)
    return path


def link_or_copy(src: str, dst: str) -> None:
    """`src` (a file or a directory tree) at `dst`: hard links on one filesystem, copies otherwise."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if os.path.isdir(src):
        shutil.copytree(src, dst, copy_function=link)
    else:
        link(src, dst)


def find_checkpoint(path: str, flag: str = "--resume") -> str:
    """A checkpoint directory: `path` itself (it holds trainer_state.pt), the one a `checkpoints/latest` file names
    (`path` the file or the run directory); FileNotFoundError naming `flag` otherwise."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    latest = path if os.path.isfile(path) else os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = os.path.join(os.path.dirname(latest), f.read().strip())
        if os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):
            return ckpt
    raise FileNotFoundError(f"{flag} {path}: neither a checkpoint (trainer_state.pt), a run directory with "
                            f"checkpoints/latest, nor a checkpoints/latest file naming one")


TRAINER_STATE_KEYS = ("step", "version", "optimizer", "mode")
#: trainer keys a checkpoint must have been trained with to resume (the default of an older checkpoint without it)
RESUMED_AS_IS = {"mode": None, "algorithm": "flow_grpo", "sharding": "replicated"}


def check_resumable(state: dict, trainer, path: str) -> None:
    """`trainer.mode`, `trainer.algorithm` and `trainer.sharding` (the optimizer state's layout) of the run are the
    checkpoint's; ValueError naming the key otherwise."""
    for key, default in RESUMED_AS_IS.items():
        was = state.get(key, default)
        if was != getattr(trainer, key):
            raise ValueError(f"trainer.{key}: the checkpoint {path} was trained with {key} {was!r}, this run has "
                             f"{getattr(trainer, key)!r}")


def read_trainer_state(ckpt: str, flag: str = "--resume") -> dict:
    """A checkpoint's trainer_state.pt, loaded with `weights_only=True`: tensors and plain containers only, so a
    resume directory cannot run code (a pickle that would is refused). ValueError naming `flag` and the file
    otherwise."""
    import pickle

    path = os.path.join(ckpt, "trainer_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{flag} {path}: refused: not loadable as plain tensors and containers (weights_only), "
                         f"so it was not unpickled; it is not an omniroll checkpoint, or one from an older "
                         f"version: start a fresh run ({first})") from None
    missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{flag} {path}: not an omniroll trainer state (missing {missing}): start a fresh run")
    return state


def run_state(trainer: Any, optimizer: Any) -> dict:
    """trainer_state.pt of a `Trainer` after `trainer.step_done` steps: step, weight version, the optimizer's state
    (`optimizer`: its state dict, or what the ranks wrote, `parallel/`), the run's mode, algorithm and sharding (checked
    on resume: `check_resumable`), the samples discarded at Ctrl-C, the config, the algorithm's own state, the KL
    reference's kept weights (`trainer.kl_reference` ema / reset), the reward controls' state (the adaptive KL gate's
    share: reward_controls.py) and the trackers' run ids."""
    tc = trainer.tc
    return {"step": trainer.step_done, "version": trainer.version, "optimizer": optimizer, "sharding": tc.sharding,
            "discarded_samples": trainer.discarded_samples, "mode": tc.mode,
            "config": trainer.config.model_dump(mode="json"), "algorithm": tc.algorithm,
            "algorithm_state": trainer.algorithm.state_dict(), "kl_reference": trainer.policy.kl_reference.state_dict(),
            "reward_controls": trainer.controls.state_dict(),
            "tracking": trainer.tracker.state(trainer.step_done) if trainer.tracker else None}


@dataclass
class Restored:
    """What a resume reads besides the weights: the steps done, the samples discarded so far, the trackers' run ids,
    and with `trainer.sharding: fsdp` the optimizer's directory, which the ranks load (None: the optimizer's state
    is in `state`, loaded by `restore`)."""

    step: int
    discarded_samples: int
    tracking: Optional[dict]
    sharded_optimizer: Optional[str]
    controls: Optional[dict] = None  # the reward controls' state (`RewardControls.state_dict`), None: none saved


def restore(path: str, tc: Any, policy: Any, algorithm: Any, optimizer: Any, store: Any) -> Restored:
    """Load checkpoint `path` into a trainer's parts (the weights, the algorithm's state, the optimizer unless it is
    sharded, the kept versions), after checking it was trained in this run's mode, algorithm and sharding."""
    state = read_trainer_state(path)  # weights_only: a resume directory cannot run code
    check_resumable(state, tc, path)
    policy.load(path)
    algorithm.load_state_dict(state.get("algorithm_state") or {})
    try:
        policy.kl_reference.load_state_dict(state.get("kl_reference") or {"kind": "base", "kept": {}})
    except ValueError as e:
        raise ValueError(f"--resume {path}: {e} (trainer.kl_reference must stay what the run trained with)") from None
    sharded = None
    if tc.sharding == "fsdp":  # the ranks load their shards themselves
        sharded = state["optimizer"]["sharded"]
        sharded = os.path.join(path, sharded) if sharded else None
    else:
        optimizer.load_state_dict(state["optimizer"])
    step = int(state["step"])
    store.load(path, step)
    return Restored(step, int(state.get("discarded_samples", 0)), state.get("tracking"), sharded,
                    state.get("reward_controls"))
