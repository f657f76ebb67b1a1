"""`omniroll eval`: GenEval on the shapes world for a model and, optionally, a trainer checkpoint.

Every prompt of `--prompts` (a split: train, heldout, all; or a file, one grammar prompt a line) `--seeds` times at
fixed seeds (the trainer's evaluation seeds: `omniroll.evaluation.shapes.eval_seed`, from `val_kwargs.seed`),
sampled with the deterministic ODE (the config's validation sampling: `val_kwargs` over `pipeline`, noise level 0),
scored by the exact checker. Prints the table (strict accuracy per category, partial
credit, the chance baseline) and writes `eval.json` (the table and every picture's result) and `eval_grid.png`
(pictures captioned with their prompt, green when they pass, red when they fail) to `--out`.
"""

from __future__ import annotations

import json
import os
import time

from omniroll.cli.common import add_config_arguments, build_config, preflight, quiet_libraries

HELP = "GenEval-style evaluation on the shapes world (strict accuracy per category, a grid, a JSON file)"


def add_arguments(parser) -> None:
    add_config_arguments(parser, config_help="optional YAML config (its engine, pipeline and val_kwargs sections are "
                                             "used); flags override it")
    parser.add_argument("--checkpoint", "--lora", dest="checkpoint", default=None,
                        help="a checkpoint `omniroll train` wrote (LoRA or full; a run directory means its latest) "
                             "applied to --model (default: none, the model itself)")
    parser.add_argument("--prompts", default="train", help="train, heldout, all, or a file of grammar prompts (one a "
                                                           "line)")
    parser.add_argument("--seeds", type=int, default=4, help="pictures per prompt, at seeds 0 .. N-1")
    parser.add_argument("--out", default="out/eval", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from omniroll.cli import UserError
    from omniroll.tasks.shapes.splits import prompts_of

    if not 1 <= args.seeds <= 1000:
        raise UserError(f"--seeds must be an int in [1, 1000], got {args.seeds}")
    cfg = build_config(args)
    try:
        prompts = prompts_of(args.prompts)
    except (ValueError, FileNotFoundError) as e:
        raise UserError([f"--prompts: {line}" for line in str(e).splitlines()]) from None
    ckpt = None
    if args.checkpoint is not None:
        from omniroll.evaluation.checkpoints import checkpoint_kind
        from omniroll.train.checkpoint import find_checkpoint

        try:
            ckpt = find_checkpoint(args.checkpoint, flag="--checkpoint")
            checkpoint_kind(ckpt)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"--checkpoint: {e}") from None
    if args.quiet:
        quiet_libraries()
    model = preflight(cfg, prompts)
    result = evaluate_model(cfg, model, prompts, args.seeds, ckpt, args.out, progress=not args.quiet)
    print(result["table"])
    print(json.dumps({"overall_strict": result["overall"]["strict"], "images": result["overall"]["n"],
                      "seconds": round(result["seconds"], 1)}))
    for p in result["files"].values():
        print(f"  {os.path.abspath(p)}")
    return 0


def evaluate_model(cfg, model: str, prompts: list[str], seeds: int, checkpoint: str | None, out_dir: str,
                   progress: bool = False, name: str = "eval") -> dict:
    """Build the engine (with the checkpoint applied), evaluate, write the files; returns the report's dict with
    `table`, `seconds` and `files`."""
    import torch

    from omniroll.engine.config import EngineConfig
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.evaluation.checkpoints import add_lora_checkpoint, checkpoint_kind, load_full_weights
    from omniroll.evaluation.shapes import eval_sampling, evaluate, write_evaluation
    from omniroll.models import load_adapter

    kwargs = cfg.engine.engine_kwargs()
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    adapter = load_adapter(model, device=kwargs["device"], dtype=kwargs["dtype"])
    kind = checkpoint_kind(checkpoint) if checkpoint is not None else None
    if kind == "full":
        load_full_weights(adapter, checkpoint)
    engine = DiffusionEngine(adapter, EngineConfig(**kwargs))
    t0 = time.time()
    try:
        if kind == "lora":
            add_lora_checkpoint(engine, checkpoint)
        ev = evaluate(engine, prompts, seeds, eval_sampling(cfg), cfg.val_kwargs.seed, progress=progress)
    finally:
        engine.shutdown()
    seconds = time.time() - t0
    title = cfg.engine.model + (f" + {checkpoint}" if checkpoint else "")
    files = write_evaluation(ev, out_dir, name=name, title=title,
                             extra={"model": cfg.engine.model, "checkpoint": checkpoint, "seeds": seeds,
                                    "sampling": eval_sampling(cfg), "seconds": seconds})
    table = ev.report.table(f"omniroll eval: {title} ({len(set(prompts))} prompts x {seeds} seeds)")
    return {**ev.report.to_dict(), "table": table, "seconds": seconds, "files": files}
