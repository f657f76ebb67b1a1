"""The `omniroll` command line: one module per command under `omniroll/cli/`.

A command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int` (the exit status), and is
listed in `COMMANDS` below; that is all it takes to add one (`omniroll train`, `omniroll serve`, ...). Command modules
import torch, Ray and models inside `run`, so `omniroll --help` stays fast.

What `main` guarantees for every command:
- a user error (a bad flag value, config key, file, prompt, model path) prints one line per problem,
  `omniroll <command>: error: ...`, and exits 2; a traceback only with `--debug`; an output directory (`--out`,
  export's `--to`) that cannot be written is one, found before any work starts;
- Ctrl-C (SIGINT) exits 130; a command writes what already finished before it returns (see each command);
- work that failed (some samples) after the rest was written: one line per failed row, exit 1;
- any other error is a bug: one line and exit 1 (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

#: subcommand -> module under omniroll.cli
COMMANDS = {
    "demo": "omniroll.cli.demo",
    "doctor": "omniroll.cli.doctor",
    "eval": "omniroll.cli.eval",
    "export": "omniroll.cli.export",
    "generate": "omniroll.cli.generate",
    "pretrain": "omniroll.cli.pretrain",
    "rollout": "omniroll.cli.rollout",
    "serve": "omniroll.cli.serve",
    "train": "omniroll.cli.train",
}

from omniroll.cli.errors import CommandFailed, UserError  # noqa: E402,F401 - the commands' errors, re-exported
from omniroll.errors import OutputWriteError  # noqa: E402 - no torch: `omniroll --help` stays fast
from omniroll.library_warnings import silence_library_warnings  # noqa: E402 - the standard library only

#: the commands that start Ray: `--ray-address` (or RAY_ADDRESS) joins that cluster instead of starting a local one
RAY_COMMANDS = ("rollout", "train", "serve")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default unless its help states it (flags that default to the config say which key)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or action.default in (None, argparse.SUPPRESS, False, []):
            return text
        return text + " (default: %(default)s)"


def _command(name: str):
    return importlib.import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniroll", description="omniroll: online RL on flow-matching diffusion "
                                     "models, from rollout to trainer. `omniroll <command> --help` for a command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name in COMMANDS:
        module = _command(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP,
                           formatter_class=_HelpFormatter)
        module.add_arguments(p)
        if name in RAY_COMMANDS:
            p.add_argument("--ray-address", default=None,
                           help="join the Ray cluster at this address (default: $RAY_ADDRESS, else a local Ray)")
        p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    return parser


def _say_error(command: str, lines) -> None:
    for line in lines:
        print(f"omniroll {command}: error: {line}", file=sys.stderr)


def main(argv=None) -> int:
    silence_library_warnings()  # third-party warnings a user cannot act on (omniroll.library_warnings)
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    if getattr(args, "ray_address", None):
        os.environ["RAY_ADDRESS"] = args.ray_address  # what connect_ray (and Ray itself) joins
    started = time.time()
    try:
        for flag in ("out", "to"):  # every command's output directory (`export --to`), before any work
            if isinstance(getattr(args, flag, None), str):
                from omniroll.cli.common import check_out_dir

                check_out_dir(getattr(args, flag), f"--{flag}")
        return int(_command(args.command).run(args) or 0)
    except OutputWriteError as e:  # disk full, file too large, ...: which file, why, and what is on disk
        if debug:
            raise
        _say_error(args.command, [str(e), _kept(getattr(args, "out", None), started, e.path)])
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"\nomniroll {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as e:
        if debug:
            raise
        _say_error(args.command, e.problems)
        return EXIT_USAGE
    except CommandFailed as e:
        if debug:
            raise
        _say_error(args.command, e.problems)
        return EXIT_FAILED
    except (ValueError, TypeError, FileNotFoundError) as e:
        if debug:
            raise
        _say_error(args.command, _lines(e))
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback with --debug
        if debug:
            raise
        _say_error(args.command, [f"internal error: {type(e).__name__}: {(_lines(e) or [''])[0]} "
                                  f"(run with --debug for the traceback)"])
        return EXIT_FAILED


def _kept(out_dir, started: float, failed: str = "") -> str:
    """The complete files this run wrote under `out_dir` (modified since it started; writes are atomic, so a file
    that failed midway is absent, never partial), and what was not written (`failed`, the file that could not be)."""
    if not out_dir or not os.path.isdir(out_dir):
        return "kept: nothing (no output directory)"
    kept = sorted(os.path.relpath(os.path.join(d, f), out_dir) for d, _, files in os.walk(out_dir) for f in files
                  if not f.startswith(".tmp-") and os.path.getmtime(os.path.join(d, f)) >= started - 0.05)
    if not kept:
        return f"kept: nothing: no output file was complete in {out_dir}"
    shown = ", ".join(kept[:8]) + (f", ... ({len(kept) - 8} more)" if len(kept) > 8 else "")
    lost = "the rest was not written"
    if os.path.basename(failed or "") == "trajectories.safetensors":
        lost = ("not written: trajectories.safetensors, so the samples' log-probs, latents and scores are lost (the "
                "same command with the same seeds regenerates them bitwise)")
    return f"kept: {len(kept)} complete file(s) in {out_dir}: {shown}; {lost}"


def _lines(e: BaseException) -> list[str]:
    """An error in the user's words: a pydantic error one line per field (never pydantic's raw text)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        from omniroll.errors import validation_messages

        return validation_messages(e)
    return [line for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]


if __name__ == "__main__":
    sys.exit(main())
