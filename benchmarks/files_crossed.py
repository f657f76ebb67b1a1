"""Which omniroll files one `omniroll rollout` sample and one training step enter (docs/design.md, "Files a sample
crosses").

    .venv/bin/python benchmarks/files_crossed.py          # ~2 min on 2 CPUs; a table by layer, then one JSON line

Measured, not hand-traced: every process of the run records, with `sys.setprofile` and `threading.setprofile` (so the
engine's loop thread, the replica's event loop and the trainer's rollout thread are seen too), the omniroll/*.py
files whose functions it enters. That is this process and every Ray worker (replica, agent-loop worker, reward
workers): the script puts a `sitecustomize.py` on PYTHONPATH before Ray starts, so each worker installs the same
recorder at start-up, and follows the phase from a file this script writes. Ray's own hops (pickling included) run
for real, so no part of the path is traced by hand.

Phases (only the last two are counted):
- setup: building the config, the cluster (Ray, one replica, the reward workers, the agent-loop manager), a warm-up
  batch (a different prompt, so the traced sample encodes its prompt afresh), the trainer and its first step.
- sample: one rollout batch of 1 prompt x n=2 as `omniroll rollout` runs it (`examples/rollout.yaml`, one replica):
  `AgentLoopManager.generate_sequences_async` -> agent-loop worker -> routing client -> replica -> engine (caller
  thread and loop thread) -> model adapter and sampling -> reward worker -> the assembled batch.
- step: `Trainer.step(2)` (`examples/train.yaml`, 1 prompt per step, n=2): its rollout (as above), GRPO
  advantages, recompute and update, the weight sync to the replica, the step line and metrics.jsonl.

Counted like the house review (reference/house_review.md, appendix): entering a file means calling one of its
functions (a module body run by an import is not an entry), so a package `__init__.py` that only re-exports is never
counted, while one that holds code the path calls is (`config/__init__.py`); `cli/` is left out (the command's
own start and end, not the sample's path).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASE_FILE = "phase"
ENV = "OMNIROLL_FILES_CROSSED"  # the recording directory; set for Ray workers through the environment
LAYERS = ("sampling", "models", "engine", "weights", "rollout", "reward", "agent_loop", "train", "config",
          "integrations")
_phase = ["setup"]


# --------------------------------------------------------------------------------------------------- the recorder
def install_recorder(out_dir: str, follow_phase_file: bool) -> None:
    """Record `phase<TAB>file` (relative to the omniroll package) the first time a phase enters an omniroll file, in
    `out_dir/<pid>.tsv`. `follow_phase_file`: a Ray worker, whose phase is what this script last wrote."""
    import importlib.util

    root = os.path.dirname(importlib.util.find_spec("omniroll").origin) + os.sep
    out = os.path.join(out_dir, f"{os.getpid()}.tsv")
    seen: set[tuple[str, str]] = set()

    def record(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        key = (_phase[0], code.co_filename)
        if key in seen or code.co_name == "<module>":  # a module body runs at import: not an entry
            return
        seen.add(key)
        if key[1].startswith(root):
            with open(out, "a") as f:
                f.write(f"{key[0]}\t{key[1][len(root):]}\n")

    sys.setprofile(record)
    threading.setprofile(record)
    if follow_phase_file:
        threading.Thread(target=_follow, args=(os.path.join(out_dir, PHASE_FILE),), daemon=True).start()


def _follow(path: str) -> None:
    sys.setprofile(None)
    while True:
        try:
            with open(path) as f:
                _phase[0] = f.read().strip() or _phase[0]
        except OSError:
            pass
        time.sleep(0.01)


def set_phase(out_dir: str, phase: str) -> None:
    """Switch this process and (within ~10 ms; we wait 0.3 s) every recording Ray worker to `phase`."""
    time.sleep(0.3)
    with open(os.path.join(out_dir, PHASE_FILE), "w") as f:
        f.write(phase)
    _phase[0] = phase
    time.sleep(0.3)


SITECUSTOMIZE = f"""import os, sys
if os.environ.get({ENV!r}):
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    import files_crossed
    files_crossed.install_recorder(os.environ[{ENV!r}], follow_phase_file=True)
"""


# --------------------------------------------------------------------------------------------------- the run
def run_sample(out_dir: str, n: int) -> None:
    import asyncio

    from omniroll.agent_loop.cluster import RolloutCluster
    from omniroll.agent_loop.batch import command_batch
    from omniroll.config import load_config

    cfg = load_config(os.path.join(REPO, "examples", "rollout.yaml"), [f"n={n}", "replicas.count=1"])
    with RolloutCluster(cfg, log=None) as cluster:
        warm = command_batch(["a red car on a table"], n, rollout_seed=cfg.seed)
        asyncio.run(cluster.manager.generate_sequences_async(warm))
        batch = command_batch(["a blue bird in a forest"], n, rollout_seed=cfg.seed)
        set_phase(out_dir, "sample")
        out = asyncio.run(cluster.manager.generate_sequences_async(batch))
        set_phase(out_dir, "after-sample")
    assert len(out) == n, len(out)


def run_train_step(out_dir: str, n: int) -> None:
    from omniroll.config import load_config
    from omniroll.train.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "examples", "train.yaml"),
                      [f"n={n}", "trainer.prompts_per_step=1", "trainer.steps=2"])
    trainer = Trainer(cfg, os.path.join(out_dir, "train"), log=lambda msg: None)
    try:
        trainer.start()
        trainer.step(1)  # warm-up: the optimizer's state, the replica's first LoRA update
        set_phase(out_dir, "step")
        trainer.step(2)
        set_phase(out_dir, "after-step")
    finally:
        trainer.close()


# --------------------------------------------------------------------------------------------------- the count
def counted(path: str) -> bool:
    return not path.startswith("cli" + os.sep)


def files_of(out_dir: str, phase: str) -> list[str]:
    files = set()
    for name in os.listdir(out_dir):
        if name.endswith(".tsv"):
            with open(os.path.join(out_dir, name)) as f:
                files |= {line.split("\t", 1)[1].strip() for line in f if line.startswith(phase + "\t")}
    return sorted(p for p in files if counted(p))


def layer_of(path: str) -> str:
    head = path.split(os.sep, 1)[0]
    return head if head in LAYERS else "omniroll/ (top level)"


def print_table(title: str, files: list[str]) -> None:
    print(f"\n{title}: {len(files)} files")
    by_layer: dict[str, list[str]] = {}
    for p in files:
        by_layer.setdefault(layer_of(p), []).append(p)
    order = list(LAYERS) + ["omniroll/ (top level)"]
    for layer in sorted(by_layer, key=order.index):
        names = [p.split(os.sep, 1)[1] if os.sep in p and layer in LAYERS else p for p in by_layer[layer]]
        print(f"  {layer:<22} {len(names):>3}  {', '.join(names)}")


def main() -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2, help="samples per prompt (the GRPO group)")
    parser.add_argument("--keep", default=None, help="keep the recordings in this directory")
    args = parser.parse_args()
    out_dir = args.keep or tempfile.mkdtemp(prefix="omniroll-files-crossed-")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    os.environ[ENV] = out_dir  # Ray starts after this: its workers inherit both
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (out_dir, os.environ.get("PYTHONPATH")) if p)
    set_phase(out_dir, "setup")
    install_recorder(out_dir, follow_phase_file=False)
    run_sample(out_dir, args.n)
    set_phase(out_dir, "setup")
    run_train_step(out_dir, args.n)
    sys.setprofile(None)
    threading.setprofile(None)

    sample, step = files_of(out_dir, "sample"), files_of(out_dir, "step")
    print_table("one `omniroll rollout` sample (1 prompt x n)", sample)
    print_table("one training step", step)
    print(f"\ntraining step only (not in the sample): {', '.join(p for p in step if p not in sample) or '-'}")
    print(f"sample only (not in the step): {', '.join(p for p in sample if p not in step) or '-'}")
    print(f"recordings: {out_dir}")
    print(json.dumps({"rollout_sample_files": len(sample), "train_step_files": len(step)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
