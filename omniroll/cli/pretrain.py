"""`omniroll pretrain shapes --out DIR`: train the shapes model from scratch (`omniroll.models.shapes.pretrain`).

Writes DIR/checkpoint/ (a diffusers SD3 checkpoint: `--model DIR/checkpoint`), DIR/loss_curve.png, DIR/pretrain.json
(the recipe, timings, the VAE check and the GenEval-style evaluation on both splits) and DIR/eval_{train,heldout}
(.json, _grid.png). `--install` then copies the checkpoint over the shipped one (what `--model shapes` loads;
`make shapes-model` does both). `--override dit.steps=2000` changes one recipe field (repeatable).

`--distill STEPS` adds the guidance distillation (`omniroll.models.shapes.distill`): the transformer learns to draw
CFG-free what it drew at CFG `distill.guidance`, and the checkpoint's default guidance becomes 1.0. With `--from MODEL`
(`shapes`, or a checkpoint directory) only that stage runs, on MODEL's modules and recipe (`make
shapes-model-distilled`: the shipped model, 600 steps).

`omniroll pretrain shapes-video --out DIR` trains the shapes-video model (a small Wan 2.1 on the moving-shapes world:
`omniroll.models.shapes_video`), resumably: a rerun with the same DIR continues where it stopped (DIR/resume/) and
ends with the bitwise same checkpoint. `--toy` runs a few steps of tiny parts (a smoke test of the whole pipeline).
The finished checkpoint is evaluated on the moving-shapes world's train and heldout splits (`VIDEO_EVAL_SEEDS` clips
a prompt: `eval_<split>.json`, its grid, and pretrain.json's `evaluation`; not with `--toy` or `--no-eval`).
`--install` copies the finished checkpoint to where `--model shapes-video` finds it (`make shapes-video-model`).
`--two-experts --from MODEL` trains nothing: it writes DIR/checkpoint, the Wan 2.2-style two-expert checkpoint of
MODEL (`shapes-video`, or a checkpoint directory), the same transformer as both experts switched at
`--boundary-ratio` (`omniroll.models.shapes_video.two_experts`).

`omniroll pretrain shapes-proxy --out DIR` trains the shapes proxy instead (`omniroll.evaluation.shapes_proxy`, the
learned reward `fn: shapes_proxy`): DIR/weights/ (model.safetensors, config.json, SHA256SUMS, train.json with the
recipe, timings and the agreement with the checker) and DIR/generated_*.npz (the generator's pictures, reused by a
second run); `--override steps=100` changes a field of its recipe (`ProxyRecipe`), `--install` copies the weights
over the shipped ones (`make shapes-proxy`).
"""

from __future__ import annotations

import json
import os
import sys

HELP = "train the shapes model (or the shapes-video model) from scratch (VAE, transformer), or the shapes proxy reward"


def add_arguments(parser) -> None:
    parser.add_argument("model", choices=["shapes", "shapes-video", "shapes-proxy"],
                        help="the model to pretrain: the shapes model, the shapes-video model, or the shapes proxy "
                             "(the learned reward `shapes_proxy`)")
    parser.add_argument("--out", default=None, help="output directory (default: out/shapes-model, "
                                                    "out/shapes-video-model, out/shapes-proxy)")
    parser.add_argument("--toy", action="store_true", help="shapes-video only: a few steps of tiny parts (a smoke "
                                                          "test of the pipeline, not a model)")
    parser.add_argument("--until", choices=["vae", "checkpoint"], default="checkpoint",
                        help="shapes-video only: stop after the VAE and its check (vae; rerun without it to go on), "
                             "or run to the checkpoint (default)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe field, e.g. dit.steps=2000 or vae.lr=0.001, for shapes-proxy e.g. steps=100 "
                             "(repeatable; default: none, the shipped model's recipe)")
    parser.add_argument("--distill", type=int, default=None, metavar="STEPS",
                        help="guidance-distil the transformer for STEPS steps after training it (distill.steps; "
                             "default: the recipe's, 0: none)")
    parser.add_argument("--from", dest="source", default=None, metavar="MODEL",
                        help="distil MODEL (shapes, or a checkpoint directory) instead of training one: its modules "
                             "and recipe, only the distillation runs (needs --distill; default: none, train one); "
                             "shapes-video with --two-experts: the checkpoint whose transformer both experts are")
    parser.add_argument("--vae-from", default=None, metavar="MODEL",
                        help="shapes-video only: take the VAE from MODEL (shapes-video, or a checkpoint directory) "
                             "instead of training it; MODEL's VAE recipe must be this run's (default: train it)")
    parser.add_argument("--two-experts", action="store_true",
                        help="shapes-video only: write the Wan 2.2-style two-expert checkpoint of --from MODEL to "
                             "DIR/checkpoint (seconds; no training)")
    parser.add_argument("--boundary-ratio", type=float, default=None,
                        help="with --two-experts: the first expert runs while the timestep is >= this x 1000 "
                             "(default: 0.875, Wan 2.2 A14B's: 4 of the model's 10 steps)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation after training (shapes-video: "
                                                               "--toy skips it too)")
    parser.add_argument("--snapshot-every", type=int, default=0, help="also save the EMA transformer every N "
                        "steps as DIR/snapshots/step_N (the checkpoint this recipe makes with dit.steps=N); shapes "
                        "evaluates each, shapes-video does not (`omniroll eval --model DIR/snapshots/step_N`); 0: none")
    parser.add_argument("--install", action="store_true", help="copy the new checkpoint over the shipped one "
                                                               "(what --model shapes, or shapes-video, loads)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress (a bar on a terminal; shapes-video in a log: one line a minute)")


def recipe_with(overrides: list[str], base=None):
    """`base` (default: the shipped recipe) with `section.field=value` overrides (values parsed as JSON, else as
    strings)."""
    from omniroll.cli import UserError
    from omniroll.models.shapes.recipe import SHIPPED

    base = base or SHIPPED
    d = base.to_dict()
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
        return type(base).from_dict(d)
    except (TypeError, ValueError) as e:
        raise UserError(f"--override: {e}") from None


def source_recipe(source: str):
    """(the checkpoint directory `--from` names, the recipe it was made with: its recipe.json, else the shipped one)."""
    from omniroll.cli import UserError
    from omniroll.models import resolve_model
    from omniroll.models.shapes.recipe import SHIPPED, ShapesRecipe

    try:
        path = resolve_model(source)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UserError(f"--from: {e}") from None
    if not os.path.isfile(os.path.join(path, "transformer", "config.json")):
        raise UserError(f"--from: {source!r} is not a shapes checkpoint (no transformer/config.json in {path})")
    file = os.path.join(path, "recipe.json")
    if not os.path.isfile(file):
        return path, SHIPPED
    with open(file) as f:
        return path, ShapesRecipe.from_dict(json.load(f))


def default_out(out, default: str) -> str:
    """`--out`, or the model's default directory, checked as the CLI checks a given one (before any work)."""
    if out is None:
        from omniroll.cli.common import check_out_dir

        check_out_dir(default, "--out")
    return out or default


def proxy_recipe_with(overrides: list[str]):
    """The shipped proxy's recipe (`ProxyRecipe` defaults) with `field=value` overrides (values parsed as JSON)."""
    from omniroll.cli import UserError
    from omniroll.models.shapes_proxy.train import ProxyRecipe

    d = ProxyRecipe().to_dict()
    for o in overrides:
        key, sep, text = o.partition("=")
        if not sep or key not in d:
            raise UserError(f"--override {o!r}: expected FIELD=VALUE with a field of the proxy recipe {sorted(d)}")
        try:
            d[key] = json.loads(text)
        except ValueError:
            d[key] = text
    try:
        return ProxyRecipe.from_dict(d)
    except (TypeError, ValueError) as e:
        raise UserError(f"--override: {e}") from None


def run_proxy(args) -> int:
    """`omniroll pretrain shapes-proxy`: train, measure and (with --install) install the shapes proxy."""
    from omniroll.cli import UserError

    unused = [flag for flag, v in (("--distill", args.distill), ("--from", args.source)) if v is not None]
    unused += ["--snapshot-every"] if args.snapshot_every else []
    unused += ["--no-eval"] if args.no_eval else []
    if unused:
        raise UserError(f"{', '.join(unused)}: only for `omniroll pretrain shapes`, not shapes-proxy")
    recipe = proxy_recipe_with(args.override)
    from omniroll.cli.common import quiet_libraries
    from omniroll.evaluation.shapes_proxy import train_proxy

    quiet_libraries()
    record = train_proxy(recipe, args.out, progress=not args.quiet and sys.stderr.isatty())
    t, a = record["times"], record["agreement"].get("heldout_generated")
    print(f"omniroll pretrain shapes-proxy: {record['parameters']} parameters, "
          + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in t.items()))
    if a is not None:
        c = a["confusion"]
        print(f"  agreement with the checker on {a['n']} held-out generated pictures: {100 * a['accuracy']:.1f} % "
              f"(checker passes {100 * a['checker_pass_rate']:.1f} %; balanced {100 * a['balanced_accuracy']:.1f} "
              f"%; pass->pass {c['pass_pass']}, pass->fail {c['pass_fail']}, fail->pass {c['fail_pass']}, "
              f"fail->fail {c['fail_fail']}; ECE {a['calibration']['ece']:.3f})")
    weights = os.path.join(args.out, "weights")
    if args.install:
        from omniroll.models.shapes_proxy import FILES, REMAKE, WEIGHTS, WHAT, load_proxy
        from omniroll.models.shipped import install

        install(weights, WEIGHTS, WHAT, REMAKE, FILES)
        load_proxy.cache_clear()
        print(f"installed as the shipped shapes proxy: {WEIGHTS}")
    for name in sorted(os.listdir(weights)):
        print(f"  {os.path.join(os.path.abspath(weights), name)}")
    return 0


#: clips per prompt of the shapes-video model's evaluation after pretraining (train and heldout: 1,752 clips)
VIDEO_EVAL_SEEDS = 4


def evaluate_checkpoint(ckpt: str, out_dir: str, seeds: int, progress: bool, final: bool = True,
                        splits: tuple[str, ...] = ("train", "heldout")) -> dict:
    """`omniroll eval`'s evaluation of `ckpt` on each split of its world (`eval_<split>.json` and its grid in
    `out_dir`; a file's split is named by its stem), its table printed (`final`; else one line); returns {split: the
    report, without the pictures themselves}."""
    from omniroll.cli.eval import evaluate_model
    from omniroll.config import load_config
    from omniroll.evaluation.worlds import world_of

    cfg = load_config({"engine": {"model": ckpt, "max_batch_size": 64}})
    world = world_of(ckpt)
    out = {}
    for split in splits:
        name = os.path.splitext(os.path.basename(split))[0]
        res = evaluate_model(cfg, ckpt, world.prompts_of(split), seeds, None, out_dir, progress=progress,
                             name=f"eval_{name}")
        table = res.pop("table")
        res.pop("evaluation")  # the pictures themselves: eval_<split>.json has their verdicts
        print(table if final else f"{ckpt}: {name} strict {100 * res['overall']['strict']:.1f} % "
                                  f"(chance {100 * res['overall']['chance']:.1f} %)")
        out[name] = res
    return out


def run(args) -> int:
    from omniroll.cli import UserError

    if args.model == "shapes-video":
        return run_video(args)
    if (args.toy or args.until != "checkpoint" or args.two_experts or args.boundary_ratio is not None
            or args.vae_from is not None):
        raise UserError("--toy, --until, --vae-from, --two-experts and --boundary-ratio are for shapes-video only "
                        "(shapes: --override dit.steps=N and the like)")
    if args.model == "shapes-proxy":
        args.out = default_out(args.out, "out/shapes-proxy")
        return run_proxy(args)
    args.out = default_out(args.out, "out/shapes-model")
    if args.distill is not None and args.distill < 0:
        raise UserError(f"--distill must be >= 0 steps, got {args.distill}")
    source, base = source_recipe(args.source) if args.source is not None else (None, None)
    recipe = recipe_with(args.override + ([f"distill.steps={args.distill}"] if args.distill is not None else []),
                         base)
    if source is not None and recipe.distill.steps < 1:
        raise UserError("--from: only the distillation runs on an existing checkpoint: give it --distill STEPS "
                        "(STEPS >= 1; 600 took about 20 minutes on 2 cores, latents included)")
    if source is not None and base.distill.steps > 0:
        raise UserError(f"--from: {args.source!r} is already guidance-distilled ({base.distill.steps} steps, its "
                        f"default guidance is 1.0): distil the guided model it came from")
    from omniroll.cli.common import quiet_libraries
    from omniroll.models.shapes.pretrain import distill_checkpoint, pretrain

    quiet_libraries()
    progress = not args.quiet and sys.stderr.isatty()

    def evaluate(ckpt: str) -> dict:
        final = os.path.basename(ckpt) == "checkpoint"
        out_dir = args.out if final else ckpt + "_eval"  # snapshots/step_N_eval/
        return evaluate_checkpoint(ckpt, out_dir, recipe.eval_seeds, progress, final)

    if args.snapshot_every < 0:
        raise UserError(f"--snapshot-every must be >= 0, got {args.snapshot_every}")
    if source is not None:
        record = distill_checkpoint(recipe, source, args.out, evaluate=None if args.no_eval else evaluate,
                                    progress=progress)
    else:
        record = pretrain(recipe, args.out, evaluate=None if args.no_eval else evaluate, progress=progress,
                          snapshot_every=args.snapshot_every)
    t = record["times"]
    stages = [(k, t[f"{k}_s"]) for k in ("vae", "latents", "transformer", "distill") if f"{k}_s" in t]
    print(f"omniroll pretrain shapes: trained in {t['train_total_s'] / 60:.1f} min ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in stages) + f"); checkpoint {record['checkpoint']}")
    if args.install:
        from omniroll.models.shapes import CHECKPOINT, REMAKE, WHAT, checkpoint_dir
        from omniroll.models.shipped import install

        install(record["checkpoint"], CHECKPOINT, WHAT, REMAKE)
        checkpoint_dir.cache_clear()
        print(f"installed as the shipped shapes model: {CHECKPOINT} (`git diff --stat` shows whether it changed)")
    for name in sorted(os.listdir(args.out)):
        print(f"  {os.path.join(os.path.abspath(args.out), name)}")
    return 0


def run_two_experts(args) -> int:
    """`omniroll pretrain shapes-video --two-experts --from MODEL`: MODEL's two-expert checkpoint in DIR/checkpoint."""
    from omniroll.cli import UserError
    from omniroll.models import resolve_model
    from omniroll.models.shapes_video.two_experts import DEFAULT_BOUNDARY, make_two_experts

    unused = [flag for flag, used in (("--toy", args.toy), ("--until", args.until != "checkpoint"),
                                      ("--override", bool(args.override)), ("--distill", args.distill is not None),
                                      ("--snapshot-every", args.snapshot_every != 0), ("--install", args.install),
                                      ("--no-eval", args.no_eval), ("--vae-from", args.vae_from is not None)) if used]
    if unused:
        raise UserError(f"{', '.join(unused)}: not with --two-experts (it trains nothing: it copies --from MODEL's "
                        f"checkpoint with its transformer as both experts)")
    if args.source is None:
        raise UserError("--two-experts needs --from MODEL: shapes-video, or a shapes-video checkpoint directory")
    out = default_out(args.out, "out/shapes-video-two-experts")
    ratio = DEFAULT_BOUNDARY if args.boundary_ratio is None else args.boundary_ratio
    try:
        source = resolve_model(args.source)
        path = make_two_experts(source, os.path.join(out, "checkpoint"), ratio)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UserError(f"--two-experts: {e}") from None
    print(f"omniroll pretrain shapes-video --two-experts: {path} (the transformer of {source} as both experts, "
          f"boundary_ratio {ratio}; --model {path})")
    return 0


def run_video(args) -> int:
    """`omniroll pretrain shapes-video`: the recipe (FULL, or TOY with --toy) with its overrides, run or resumed."""
    from omniroll.cli import UserError
    from omniroll.cli.common import quiet_libraries
    from omniroll.models.shapes_video.recipe import FULL, TOY

    if args.two_experts:
        return run_two_experts(args)
    unused = [flag for flag, used in (("--distill", args.distill is not None), ("--from", args.source is not None),
                                      ("--boundary-ratio", args.boundary_ratio is not None)) if used]
    if unused:
        raise UserError(f"{', '.join(unused)}: not available for shapes-video (evaluate its checkpoint with "
                        f"`omniroll eval --model DIR/checkpoint`)")
    if args.install and (args.toy or args.until != "checkpoint"):
        raise UserError("--install: only a full run to the checkpoint is installed as the shipped shapes-video model "
                        "(not --toy, not --until vae)")
    recipe = recipe_with(args.override, TOY if args.toy else FULL)
    out = default_out(args.out, "out/shapes-video-model")
    from omniroll.models import resolve_model
    from omniroll.models.shapes_video.pretrain import pretrain

    quiet_libraries()
    resumed = os.path.isdir(os.path.join(out, "resume"))
    try:
        vae_from = None if args.vae_from is None else resolve_model(args.vae_from)
        record = pretrain(recipe, out, progress=not args.quiet, until=args.until,  # bars, or lines in a log
                          vae_from=vae_from, snapshot_every=args.snapshot_every)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    t, sps = record["times"], record["seconds_per_step"]
    print(f"omniroll pretrain shapes-video: {'resumed and ' if resumed else ''}finished {args.until} in "
          f"{t['total_s'] / 60:.1f} min this run (" + ", ".join(f"{k} {t[k + '_s']:.0f} s" for k in (
              "vae", "latents", "transformer") if k + "_s" in t) + "); seconds per step: "
          + ", ".join(f"{k} {v:.3f}" for k, v in sps.items() if v is not None))
    print(f"VAE check on held-out clips: PSNR {record['vae_check']['psnr_db']:.1f} dB, checker strict "
          f"{100 * record['vae_check']['strict_overall']:.1f} %; checkpoint {record['checkpoint']}")
    for path in record.get("snapshots", []):
        print(f"snapshot: {path} (judge it with `omniroll eval --model {path}`)")
    if record["checkpoint"] is not None and not (args.toy or args.no_eval):
        record["evaluation"] = evaluate_checkpoint(record["checkpoint"], out, VIDEO_EVAL_SEEDS,
                                                   not args.quiet and sys.stderr.isatty())
        with open(os.path.join(out, "pretrain.json"), "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    if args.install:
        from omniroll.models.shapes_video import CHECKPOINT, install

        try:
            install(record["checkpoint"], CHECKPOINT)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"--install: {e}") from None
        print(f"installed as the shipped shapes-video model: {CHECKPOINT} (`--model shapes-video`)")
    for name in sorted(os.listdir(out)):
        print(f"  {os.path.join(os.path.abspath(out), name)}")
    return 0
