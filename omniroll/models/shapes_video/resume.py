"""Resumable training phases: a phase's state (modules, optimizer, EMA, torch's RNG state, the step, its history)
saved every `every` steps to `<resume_dir>/<phase>.pt`, and loaded by a rerun, which continues at the saved step.

A resumed run ends bitwise where an uninterrupted one ends as long as each step's randomness is a function of the
step alone (the batch drawn from (seed, step), the noise from a generator seeded by (seed, step): `step_generator`),
and the thread count is the same. Files are written to a temporary name and renamed, so an interruption while saving
leaves the previous state. `check_recipe` refuses to resume a directory written by a different recipe.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

RECIPE_FILE = "recipe.json"


def step_generator(seed: int, step: int) -> torch.Generator:
    """A torch generator for one step of one phase: the same for the same (seed, step)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def save_atomic(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def check_recipe(resume_dir: str, recipe: dict, written_before: Optional[dict] = None) -> None:
    """Write `recipe` to `resume_dir/recipe.json`, or, when one is there, check it is the same (ValueError naming the
    fields that differ: resuming a different recipe would mix two runs). `written_before`: top-level fields newer than
    some runs' files, with the value such a run had (a file without one is read with it)."""
    os.makedirs(resume_dir, exist_ok=True)
    path = os.path.join(resume_dir, RECIPE_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            old = {**(written_before or {}), **json.load(f)}
        now = json.loads(json.dumps(recipe))
        if old != now:
            diff = sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k))
            raise ValueError(f"{path}: this output directory holds a run of another recipe (sections {diff} "
                             f"differ); resume it with the same settings, or give another --out")
        return
    with open(path + ".tmp", "w") as f:
        json.dump(recipe, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def run_phase(name: str, steps: int, step_fn: Callable[[int], dict], parts: dict, resume_dir: str, every: int,
              on_step: Optional[Callable[[int, dict], None]] = None,
              on_start: Optional[Callable[[int], None]] = None) -> list[dict]:
    """Run steps [start, steps) of phase `name`, `step_fn(step)` doing one (it returns the step's record); returns
    the history of every step (the loaded one's included). `parts`: {name: object with state_dict /
    load_state_dict} (modules, optimizers, EMAs). The state is saved after every `every`-th step and after the last;
    `on_step(step, record)` (step counted from 1) runs after the save, so an exception it raises loses no saved step.
    `on_start(start)` runs once with the step it starts at (0, or the loaded one). A finished phase's file stays: a
    rerun loads it and runs no step."""
    if every < 1:
        raise ValueError(f"resume_every must be >= 1 step, got {every}")
    path = os.path.join(resume_dir, f"{name}.pt")
    history, start = [], 0
    if os.path.isfile(path):
        state = torch.load(path, weights_only=True)
        if state["steps"] != steps or sorted(state["parts"]) != sorted(parts):
            raise ValueError(f"{path}: saved for {state['steps']} steps of {sorted(state['parts'])}, asked for "
                             f"{steps} of {sorted(parts)}")
        for key, obj in parts.items():
            obj.load_state_dict(state["parts"][key])
        torch.set_rng_state(state["torch_rng"])
        history, start = list(state["history"]), int(state["step"])
    if on_start is not None:
        on_start(start)
    for step in range(start, steps):
        record = {"step": step + 1, **step_fn(step)}
        history.append(record)
        if (step + 1) % every == 0 or step + 1 == steps:
            save_atomic({"step": step + 1, "steps": steps, "history": history, "torch_rng": torch.get_rng_state(),
                         "parts": {k: obj.state_dict() for k, obj in parts.items()}}, path)
        if on_step is not None:
            on_step(step + 1, record)
    return history
