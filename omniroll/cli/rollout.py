"""`omniroll rollout`: one rollout batch end to end (replicas, reward workers, agent-loop manager) on Ray (joined at
`RAY_ADDRESS` / `--ray-address`, else local): the command line of `omniroll.run_rollout.run_rollout`, which writes
the files (images, trajectories, rewards.jsonl, metrics.json). A group that finished is kept when another fails or
the run is interrupted (Ctrl-C: what finished is written, exit 130); each failed row is one line.
"""

from __future__ import annotations

import json

from omniroll.cli import CommandFailed
from omniroll.cli.common import add_config_arguments, add_prompt_arguments, build_config, preflight, read_prompts

HELP = "the distributed path (replicas, agent loop, rewards) on Ray (local, or joined with --ray-address)"


def add_arguments(parser) -> None:
    add_prompt_arguments(parser)
    add_config_arguments(parser, config_help="YAML rollout config (see examples/rollout.yaml); flags override it",
                         config_required=True)
    parser.add_argument("--validate", action="store_true",
                        help="a validation batch: val_kwargs (its n, seed, pipeline and algo overlay) instead of the "
                             "training settings; --n then sets val_kwargs.n")
    parser.add_argument("--out", default="out/rollout", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args) -> int:
    import asyncio

    from omniroll.run_rollout import run_rollout  # torch and Ray: imported when the command runs
    from omniroll.agent_loop.worker import AgentLoopError

    if args.validate and getattr(args, "n", None) is not None:
        args.override = list(args.override) + [f"val_kwargs.n={args.n}"]
        del args.n
    cfg = build_config(args)
    prompts = read_prompts(args)
    preflight(cfg, prompts)
    n = cfg.val_kwargs.n if args.validate else cfg.n
    try:
        batch = asyncio.run(run_rollout(cfg, prompts, n=n, out_dir=args.out, progress=not args.quiet,
                                        validate=args.validate))
    except AgentLoopError as e:  # the finished rows were written
        raise CommandFailed([_row_line(f) for f in e.failed_rows]) from None
    print(json.dumps({"num_samples": len(batch), "out": args.out}))
    nt = batch.non_tensor_batch
    failed = [i for i, s in enumerate(nt.get("status", [])) if s == "failed"]
    if failed:  # agent.on_failure: mark: the rows are in the files, marked; say so once each
        raise CommandFailed([_row_line({"row": i, "uid": nt["uid"][i], "request_id": nt["request_id"][i],
                                        "error": (nt.get("error") or [None] * len(batch))[i]}) for i in failed])
    return 0


def _row_line(f: dict) -> str:
    return f"row {f['row']} (uid={f.get('uid')!r}, request_id={f.get('request_id')!r}) failed: {f.get('error')}"
