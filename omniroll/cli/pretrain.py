"""`omniroll pretrain shapes --out DIR`: train the shapes model from scratch (`omniroll.models.shapes.pretrain`).

Writes DIR/checkpoint/ (a diffusers SD3 checkpoint: `--model DIR/checkpoint`), DIR/loss_curve.png, DIR/pretrain.json
(the recipe, timings, the VAE check and the GenEval-style evaluation on both splits) and DIR/eval_{train,heldout}
(.json, _grid.png). `--install` then copies the checkpoint over the shipped one (what `--model shapes` loads;
`make shapes-model` does both). `--override dit.steps=2000` changes one recipe field (repeatable).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HELP = "train the shapes model from scratch (VAE, transformer) and evaluate it"


def add_arguments(parser) -> None:
    parser.add_argument("model", choices=["shapes"], help="the model to pretrain")
    parser.add_argument("--out", default="out/shapes-model", help="output directory")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe field, e.g. dit.steps=2000 or vae.lr=0.001 (repeatable; default: none, the "
                             "shipped model's recipe)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    parser.add_argument("--snapshot-every", type=int, default=0, help="also save and evaluate the EMA transformer "
                        "every N steps as DIR/snapshots/step_N (the checkpoint this recipe makes with dit.steps=N); "
                        "0: none")
    parser.add_argument("--install", action="store_true", help="copy the new checkpoint over the shipped one "
                                                               "(what --model shapes loads)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def recipe_with(overrides: list[str]):
    """The shipped recipe with `section.field=value` overrides (values parsed as JSON, else as strings)."""
    from omniroll.cli import UserError
    from omniroll.models.shapes.recipe import SHIPPED, ShapesRecipe

    d = SHIPPED.to_dict()
    problems = []
    for o in overrides:
        key, sep, text = o.partition("=")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *path, name = key.split(".")
        node = d
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not sep or not isinstance(node, dict) or name not in node:
            problems.append(f"--override {o!r}: expected SECTION.FIELD=VALUE with a field of the recipe "
                            f"(e.g. dit.steps=2000; sections {sorted(k for k, v in d.items() if isinstance(v, dict))})")
            continue
        node[name] = value
    if problems:
        raise UserError(problems)
    try:
        return ShapesRecipe.from_dict(d)
    except (TypeError, ValueError) as e:
        raise UserError(f"--override: {e}") from None


def run(args) -> int:
    from omniroll.cli import UserError

    recipe = recipe_with(args.override)
    from omniroll.cli.common import quiet_libraries
    from omniroll.models.shapes.pretrain import pretrain

    quiet_libraries()
    progress = not args.quiet and sys.stderr.isatty()

    def evaluate(ckpt: str) -> dict:
        from omniroll.cli.eval import evaluate_model
        from omniroll.config import load_config
        from omniroll.tasks.shapes.splits import prompts_of

        cfg = load_config({"engine": {"model": ckpt, "max_batch_size": 64}})
        final = os.path.basename(ckpt) == "checkpoint"
        out_dir = args.out if final else ckpt + "_eval"  # snapshots/step_N_eval/
        out = {}
        for split in ("train", "heldout"):
            res = evaluate_model(cfg, ckpt, prompts_of(split), recipe.eval_seeds, None, out_dir,
                                 progress=progress, name=f"eval_{split}")
            table = res.pop("table")
            print(table if final else f"{ckpt}: {split} strict {100 * res['overall']['strict']:.1f} % "
                                      f"(chance {100 * res['overall']['chance']:.1f} %)")
            out[split] = res
        return out

    if args.snapshot_every < 0:
        raise UserError(f"--snapshot-every must be >= 0, got {args.snapshot_every}")
    record = pretrain(recipe, args.out, evaluate=None if args.no_eval else evaluate, progress=progress,
                      snapshot_every=args.snapshot_every)
    t = record["times"]
    print(f"omniroll pretrain shapes: trained in {t['train_total_s'] / 60:.1f} min (VAE {t['vae_s']:.0f} s, latents "
          f"{t['latents_s']:.0f} s, transformer {t['transformer_s']:.0f} s); checkpoint {record['checkpoint']}")
    if args.install:
        from omniroll.models.shapes import CHECKPOINT, verified

        shutil.rmtree(CHECKPOINT, ignore_errors=True)
        shutil.copytree(record["checkpoint"], CHECKPOINT)
        verified.cache_clear()
        verified(CHECKPOINT)
        print(f"installed as the shipped shapes model: {CHECKPOINT} (`git diff --stat` shows whether it changed)")
    for name in sorted(os.listdir(args.out)):
        print(f"  {os.path.join(os.path.abspath(args.out), name)}")
    return 0
