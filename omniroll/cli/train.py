"""`omniroll train --config CFG --out DIR [--steps N] [--resume DIR]`: `trainer.algorithm` (Flow-GRPO by default;
every algorithm of `omniroll.config.algorithms.ALGORITHMS`) on local Ray (`Trainer`).

The config (with its `trainer` section) is validated before Ray starts: a bad key fails at once, named. One line per
step above a progress bar over steps (the bar only on a terminal: in a log file, one clean line per step). Trackers:
`trainer.logger` (omniroll.train.report.tracking). Ctrl-C writes the checkpoint of the last completed step and exits 130
(an update and its weight sync are never cut in half). A run whose every GRPO group has been tied for
`trainer.signal_check.stop_after_tied_steps` steps stops: the checkpoint of its last step, then exit 1 with what was
measured, the likely cause and what to change, one line each (`NoLearningSignal`). Writes to DIR: metrics.jsonl,
reward_curve.png, val_before.png / val_after.png (captioned ODE grids of the fixed validation prompts and seeds),
validation.jsonl, checkpoints/step_N/ (LoRA in PEFT's save_pretrained format, trainer_state.pt), checkpoints/latest.
"""

from __future__ import annotations

import os
import sys

from omniroll.config.algorithms import ALGORITHMS

HELP = (f"train with trainer.algorithm ({', '.join(spec.title for spec in ALGORITHMS.values())}): rollout replicas "
        "and streaming rewards on Ray, exact ratios")


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="YAML with a trainer section (see examples/train.yaml)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=None,
                   help="train until this step (default: trainer.steps; a trainer.steps in $OMNIROLL_OVERRIDES wins)")
    p.add_argument("--resume", default=None, help="a run directory (its latest checkpoint) or a checkpoint directory "
                                                  "(default: none, a fresh run)")
    p.add_argument("--override", action="append",
                   help="dotted config override, e.g. trainer.lr=0.001 (repeatable; default: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none unless stdout and stderr "
                   "are a terminal)")


def run(args) -> int:
    from omniroll.cli import UserError
    from omniroll.cli.common import ENV_OVERRIDES, env_override, env_overrides, preflight
    from omniroll.config import load_config

    # the bar only when both streams are a terminal: in a log file (CI, nohup) one clean line per step
    bar = not args.quiet and sys.stdout.isatty() and sys.stderr.isatty()
    if not bar:  # nor the model-loading bars of diffusers / transformers (their public switches)
        import diffusers.utils.logging
        import transformers.utils.logging

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()

    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    # --steps is trainer.steps' flag: config < --override < --steps < $OMNIROLL_OVERRIDES (last, as for every command)
    steps = [f"trainer.steps={args.steps}"] if args.steps is not None else []
    env_steps = env_override("trainer.steps")
    if steps and env_steps:
        print(f"omniroll train: --steps {args.steps} yields to ${ENV_OVERRIDES}'s {env_steps}", file=sys.stderr)
    # names the bad key; nothing has started yet
    cfg = load_config(args.config, overrides=(args.override or []) + env_overrides())
    if cfg.trainer is None:
        raise UserError(f"{args.config}: no trainer section (see examples/train.yaml)")
    if steps:
        cfg = load_config(args.config, overrides=(args.override or []) + steps + env_overrides())
    preflight(cfg, cfg.trainer.all_prompts())  # the model (the config checked its limits and the rewards)
    from omniroll.train.report.tracking import check_loggers

    check_loggers(cfg.trainer.logger)  # a named tracker that is not installed: its pip command, before Ray starts
    if args.resume:
        from omniroll.train.checkpoint import find_checkpoint, read_trainer_state

        read_trainer_state(find_checkpoint(args.resume))  # a bad --resume fails before Ray starts too (never unpickled)

    from tqdm import tqdm

    from omniroll.cli import CommandFailed
    from omniroll.train.parallel.distributed import TrainerRankError
    from omniroll.train.colocation import ColocationError
    from omniroll.train.report.signal_check import NoLearningSignal
    from omniroll.train.report.stage_memory import StageOutOfMemory
    from omniroll.train.trainer import Trainer

    def log(line: str) -> None:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    trainer = Trainer(cfg, args.out, resume=args.resume, log=log)
    try:
        with trainer:
            trainer.train(progress=bar)
    except KeyboardInterrupt:
        print(f"\nomniroll train: interrupted; checkpoint of step {trainer.step_done} in "
              f"{os.path.join(args.out, 'checkpoints')} (continue with --resume {args.out})", file=sys.stderr)
        return 130
    except TrainerRankError as e:  # a data-parallel rank died or failed: exit 1, one line naming it and its node
        ckpts = os.path.join(args.out, "checkpoints")
        raise CommandFailed([f"{e}; the checkpoint of step {trainer.step_done}, the last completed, is in {ckpts} "
                             f"(continue with --resume {args.out})"]) from None
    except (StageOutOfMemory, ColocationError) as e:  # the device: one line naming the stage, or the replicas
        raise CommandFailed([str(e)]) from None
    except NoLearningSignal as e:  # exit 1, one line per problem (omniroll.cli.main)
        raise CommandFailed(e.problems + [f"stopped after step {trainer.step_done}; its checkpoint is in "
                                          f"{os.path.join(args.out, 'checkpoints')}"]) from None
    out = os.path.abspath(args.out)
    print(f"omniroll train: {trainer.step_done} steps; outputs in {out}")
    for name in sorted(os.listdir(out)):
        print(f"  {os.path.join(out, name)}")
    return 0
