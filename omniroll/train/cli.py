"""`omniroll train --config CFG --out DIR [--steps N] [--resume DIR] [--override k=v]`.

The config (with its `trainer` section) is validated before Ray starts: a bad key fails at once, named. One line per
step and a progress bar over steps; Ctrl-C writes the checkpoint of the last completed step and exits 130.
"""

from __future__ import annotations

import os
import sys


def run_train(args) -> int:
    from omniroll.config import load_config
    from omniroll.train.artifacts import find_checkpoint

    cfg = load_config(args.config, overrides=args.override or [])  # ConfigError names the key; nothing started yet
    if cfg.trainer is None:
        raise ValueError(f"{args.config}: no trainer section (see examples/train.yaml)")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.resume:
        find_checkpoint(args.resume)  # a bad --resume fails before Ray starts too

    from tqdm import tqdm

    from omniroll.train.trainer import FlowGRPOTrainer

    trainer = FlowGRPOTrainer(cfg, args.out, resume=args.resume, log=lambda s: tqdm.write(s, file=sys.stdout))
    try:
        with trainer:
            trainer.train(args.steps, progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"omniroll train: interrupted; checkpoint of step {trainer.step_done} in "
              f"{os.path.join(args.out, 'checkpoints')}", file=sys.stderr)
        return 130
    out = os.path.abspath(args.out)
    print(f"omniroll train: {trainer.step_done} steps; outputs in {out}")
    for name in sorted(os.listdir(out)):
        print(f"  {os.path.join(out, name)}")
    return 0
