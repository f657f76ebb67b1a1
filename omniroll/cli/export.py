"""`omniroll export`: a checkpoint `omniroll train` wrote, as files diffusers loads (omniroll/export/write.py).

Without `--merge`, a LoRA checkpoint becomes `DIR/pytorch_lora_weights.safetensors` (`pipe.load_lora_weights(DIR)`
on the base model's pipeline); with `--merge`, a LoRA or full-weight checkpoint becomes a whole pipeline directory
(`DiffusionPipeline.from_pretrained(DIR)`). `--check` then generates one picture from the export with diffusers and
one with omniroll's engine and the checkpoint, at the same seed and ODE sampler, prints the largest differences and
exits 1 when they exceed the export's tolerance (omniroll/export/check.py). docs/export.md has the details.
"""

from __future__ import annotations

import json
import os

from omniroll.engine.params import DTYPE_NAMES  # no torch: `omniroll --help` stays fast

HELP = "export a trainer checkpoint for diffusers: a LoRA file (load_lora_weights) or, with --merge, a whole pipeline"


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a checkpoint directory `omniroll train` wrote (checkpoints/step_N), or a run directory "
                             "(its latest checkpoint)")
    parser.add_argument("--to", required=True, metavar="DIR", help="the export directory (new or empty)")
    parser.add_argument("--merge", action="store_true",
                        help="write a whole diffusers pipeline with the trained weights in its transformer (a LoRA "
                             "fused in); required for a full-weight checkpoint")
    parser.add_argument("--check", action="store_true",
                        help="load the export with diffusers, generate one picture against omniroll's engine with "
                             "the checkpoint (same seed, ODE), print the differences; exit 1 beyond the tolerance")
    parser.add_argument("--model", default=None,
                        help="the base model the checkpoint was trained on (default: its trainer_state.pt's "
                             "engine.model)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="the dtype the exported weights are written in")


def run(args) -> int:
    from omniroll.cli import CommandFailed, UserError
    from omniroll.cli.common import quiet_libraries
    from omniroll.export.write import check_target, export_checkpoint, export_source

    try:
        check_target(args.to)  # before any model loads
        source = export_source(args.checkpoint, args.model)
        if args.check:
            from omniroll.export.check import require_checkable

            require_checkable(source, args.dtype)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e).splitlines()) from None
    quiet_libraries()
    try:
        files = export_checkpoint(source, args.to, merge=args.merge, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:  # a file of the checkpoint or model that is not there, a mismatch
        raise UserError(str(e).splitlines()) from None
    except OSError as e:  # disk full, no permission, ...: the temporary directory was removed
        raise CommandFailed(f"--to {args.to}: the export could not be written ({e}); nothing was written") from None
    what = "merged pipeline" if args.merge else "LoRA"
    print(json.dumps({"export": what, "checkpoint": source.checkpoint, "model": source.model_dir,
                      "to": os.path.abspath(args.to), "files": len(files)}))
    if args.check:
        from omniroll.export.check import check_export

        result = check_export(source, args.to, merged=args.merge)
        print(result.line())
        if not result.passed:
            raise CommandFailed(f"--check: the export differs from omniroll's engine beyond the tolerance (the "
                                f"export is in {os.path.abspath(args.to)})")
    return 0
