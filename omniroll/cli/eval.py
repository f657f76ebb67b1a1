"""`omniroll eval`: GenEval on the shapes world (or on the moving-shapes world, for a video model) for a model and,
optionally, a trainer checkpoint, with its standard errors, and paired with a baseline at the same prompts and seeds.

The world is the model's (`omniroll.evaluation.worlds.world_of`: its checkpoint's `omniroll_defaults.json` task; a
shapes-video checkpoint says moving_shapes, any other the shapes world). Every prompt of `--prompts` (a split of that
world: train, heldout, all; or a file, one grammar prompt a line) `--seeds` times
(default: the config's `trainer.evaluation.seeds`, else 16) at fixed seeds (the trainer's evaluation seeds:
`omniroll.evaluation.shapes.eval_seed`, from `val_kwargs.seed`), sampled with the deterministic ODE (the config's
validation sampling: `val_kwargs` over `pipeline`, noise level 0) at the guidance scale `--guidance` (default: the
regime the checkpoint trained in, CFG off for NFT and AWM; else the validation sampling's), scored by the exact
checker. Prints the table (strict accuracy per category with its standard error, partial credit, the chance
baseline) and writes `eval.json` (the table and every picture's result) and `eval_grid.png` (pictures captioned with
their prompt: a check mark and green when they pass, a cross and red when they fail) to `--out`. A clip is shown as
its film strip (frames left to right, the verdict and a failure's reason under it), its chance baseline is its
prompt's antithetic twin, and the table is followed by the frame baselines: the model's own clips frozen to their
first frame and shuffled, per category, with the model's paired z against each (eval.json's `baselines`).

`--baseline BASE` (a checkpoint, a run directory, or `none`: the model itself) evaluates BASE at the same prompts,
seeds and guidance first (`baseline.json`, `baseline_grid.png`), then pairs the two (`omniroll.evaluation.paired`):
pictures fail -> pass (up), pass -> fail (down), McNemar's z, per category and overall, in eval.json's `paired` field;
prints the paired table and a verdict ("no detectable change" when |z| < 2); frames the flipped pictures in the grid
and draws them, the baseline's above the checkpoint's, in `flips.png`. `--baseline-guidance G` draws the baseline at
another CFG scale (a CFG-free model after RL against its guided base), and `--baseline-model MODEL` applies BASE to
another model (a guidance-distilled model against the shipped one, with its own sampling defaults); either alone
means `--baseline none`. The seeds, hence the initial noise, stay those of the evaluated model.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from omniroll.cli.common import add_config_arguments, build_config, preflight, quiet_libraries

HELP = ("GenEval-style evaluation on the shapes world, or the moving-shapes world for a video model (strict accuracy "
        "per category, paired with a baseline)")
DEFAULT_SEEDS = 16  # the demo's 37 training prompts: a standard error of about 2 points (docs/evaluation.md)


def add_arguments(parser) -> None:
    add_config_arguments(parser, config_help="optional YAML config (its engine, pipeline and val_kwargs sections are "
                                             "used); flags override it")
    parser.add_argument("--checkpoint", "--lora", dest="checkpoint", default=None,
                        help="a checkpoint `omniroll train` wrote (LoRA or full; a run directory means its latest) "
                             "applied to --model (default: none, the model itself)")
    parser.add_argument("--baseline", default=None, metavar="BASE",
                        help="also evaluate BASE (a checkpoint, a run directory, or 'none': the model itself) at the "
                             "same prompts, seeds and guidance (unless --baseline-guidance), and pair the two "
                             "(default: no baseline)")
    parser.add_argument("--baseline-guidance", type=float, default=None, metavar="G",
                        help="the baseline's CFG scale (<= 1 turns CFG off), in [0, 100] (default: --guidance's, the "
                             "evaluated model's); without --baseline, the baseline is the model itself")
    parser.add_argument("--baseline-model", default=None, metavar="MODEL",
                        help="the model BASE applies to (a model as --model takes it, with its own sampling defaults; "
                             "default: --model); without --baseline, the baseline is MODEL itself")
    parser.add_argument("--prompts", default="train", help="train, heldout, all, or a file of grammar prompts (one a "
                                                           "line)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"pictures per prompt, at seeds 0 .. N-1 (default: the config's trainer.evaluation.seeds, "
                             f"the trainer's own evaluation; else {DEFAULT_SEEDS})")
    parser.add_argument("--out", default="out/eval", help="output directory")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="draw every picture: by default a model evaluated as it is (no checkpoint; a baseline "
                             "'none') is read from the evaluation cache when the same weights, sampling and seeds "
                             "drew it before and 8 of its pictures, drawn again, are bitwise equal or, drawn by "
                             "another CPU, have the same verdicts (else drawn and kept there: "
                             "$OMNIROLL_CACHE_DIR/evaluations; clips too)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from omniroll.cli import UserError
    from omniroll.evaluation.checkpoints import checkpoint_kind

    if args.seeds is not None and not 1 <= args.seeds <= 1000:
        raise UserError(f"--seeds must be an int in [1, 1000], got {args.seeds}")
    if args.baseline_guidance is not None and not 0 <= args.baseline_guidance <= 100:
        raise UserError(f"--baseline-guidance must be in [0, 100], got {args.baseline_guidance:g}")
    if args.baseline is None and (args.baseline_guidance is not None or args.baseline_model is not None):
        args.baseline = "none"  # the baseline model itself, at the baseline guidance
    cfg = build_config(args)
    args.seeds = eval_seeds(cfg, args.seeds)
    world = eval_world(cfg)
    try:
        prompts = world.prompts_of(args.prompts)
    except (ValueError, FileNotFoundError) as e:
        raise UserError([f"--prompts: {line}" for line in str(e).splitlines()]) from None
    ckpt = checkpoint_arg(args.checkpoint, "--checkpoint")
    base = None if args.baseline in (None, "none") else checkpoint_arg(args.baseline, "--baseline")
    trained = trained_config(ckpt)
    guidance, why = eval_guidance(cfg, ckpt, getattr(args, "guidance", None), trained)
    merge, merge_why = eval_merge_lora(cfg, ckpt, trained)
    if args.quiet:
        quiet_libraries()
    model = preflight(cfg, prompts)
    base_cfg, base_model = baseline_model(args, cfg, model, prompts)
    if base_model != model and eval_world(base_cfg, "--baseline-model") != world:
        raise UserError(f"--baseline-model: {args.baseline_model!r} is not judged in the {world.task} world of "
                        f"--model {cfg.engine.model!r}: a paired comparison needs the same prompts and checker")
    base_guidance = guidance if args.baseline_guidance is None else float(args.baseline_guidance)
    print(f"guidance {guidance:g} ({'CFG off' if guidance <= 1 else 'CFG on'}): {why}")
    if merge and ckpt is not None and checkpoint_kind(ckpt) == "lora":
        print(f"the LoRA merged into the weights: {merge_why}")
    baseline = None
    if args.baseline is not None:
        base_merge, _ = eval_merge_lora(base_cfg, base, trained_config(base))
        baseline = evaluate_model(base_cfg, base_model, prompts, args.seeds, base, args.out, progress=not args.quiet,
                                  name="baseline", guidance=base_guidance, merge_lora=base_merge, cache=args.cache)
        print(baseline["table"])
    result = evaluate_model(cfg, model, prompts, args.seeds, ckpt, args.out, progress=not args.quiet,
                            guidance=guidance, baseline=baseline, merge_lora=merge, cache=args.cache)
    print(result["table"])
    line = {"task": world.task, "overall_strict": result["overall"]["strict"], "se": result["overall"]["se"],
            "images": result["overall"]["n"], "guidance_scale": guidance, "seconds": round(result["seconds"], 1)}
    line.update({f"{name}_strict": b["overall"]["strict"] for name, b in result["baselines"].items()})
    if baseline is not None:
        print(result["paired_table"])
        line.update({"baseline_strict": baseline["overall"]["strict"], "baseline_guidance_scale": base_guidance,
                     "paired": result["paired"]["overall"]})
    print(json.dumps(line))
    for p in result["files"].values():
        print(f"  {os.path.abspath(p)}")
    return 0


def baseline_model(args, cfg, model: str, prompts: list[str]) -> tuple:
    """(the config, the resolved model directory) the baseline is drawn with: `--baseline-model`'s when given (the
    same flags and config with that model, so its own sampling defaults apply), else the evaluated model's.
    UserError naming --baseline-model."""
    import argparse

    from omniroll.cli import UserError

    if args.baseline_model is None:
        return cfg, model
    try:
        base_cfg = build_config(argparse.Namespace(**{**vars(args), "model": args.baseline_model}))
        return base_cfg, preflight(base_cfg, prompts)
    except UserError as e:  # its lines name --model, which here is --baseline-model
        lines = [p.replace("--model (engine.model)", "--baseline-model") for p in e.problems]
        raise UserError([p if p.startswith("--baseline-model") else f"--baseline-model: {p}" for p in lines]) from None


def eval_world(cfg, flag: str = "--model"):
    """The world (`omniroll.evaluation.worlds.EvalWorld`) the config's model is judged in: its checkpoint's task.
    UserError naming `flag` when the task cannot be read, or when the model draws clips (pipeline.num_frames > 1)
    and its world judges pictures, or the reverse."""
    from omniroll.cli import UserError
    from omniroll.evaluation.worlds import world_of
    from omniroll.models import resolve_model

    try:
        world = world_of(resolve_model(cfg.engine.model))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{flag} (engine.model): {e}") from None
    frames = cfg.pipeline.num_frames
    if (frames > 1) != world.clips:
        draws = f"clips of {frames} frames" if frames > 1 else "pictures (num_frames 1)"
        raise UserError(f"{flag} (engine.model): {cfg.engine.model!r} draws {draws} here, and its world ({world.task}: "
                        f"its omniroll_defaults.json task) judges {'clips' if world.clips else 'pictures'}; evaluate "
                        f"a shapes-video checkpoint (task moving_shapes) at its own frame count, or a picture model")
    return world


def eval_seeds(cfg, flag: Optional[int]) -> int:
    """Pictures per prompt: --seeds when given; else the config's `trainer.evaluation.seeds` (what its trainer's
    evaluation draws, so a run's numbers are reproduced as they were drawn); else DEFAULT_SEEDS."""
    if flag is not None:
        return flag
    ev = cfg.trainer.evaluation if cfg.trainer is not None else None
    return ev.seeds if ev is not None else DEFAULT_SEEDS


def checkpoint_arg(path: Optional[str], flag: str) -> Optional[str]:
    """The checkpoint directory a flag names (a run directory means its latest); UserError naming the flag."""
    from omniroll.cli import UserError
    from omniroll.evaluation.checkpoints import checkpoint_kind
    from omniroll.train.checkpoint import find_checkpoint

    if path is None:
        return None
    try:
        ckpt = find_checkpoint(path, flag=flag)
        checkpoint_kind(ckpt)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{flag}: {e}") from None
    return ckpt


def trained_config(checkpoint: Optional[str]) -> dict:
    """The config `checkpoint`'s run trained with, a dict of sections ({} for none): read once per checkpoint by
    `run`, for the regime (`eval_guidance`) and the merged LoRA (`eval_merge_lora`)."""
    from omniroll.train.checkpoint import read_trainer_state

    if checkpoint is None:
        return {}
    return read_trainer_state(checkpoint, flag="--checkpoint").get("config") or {}


def eval_guidance(cfg, checkpoint: Optional[str], flag: Optional[float], trained: dict) -> tuple[float, str]:
    """(the guidance scale to evaluate at, why): --guidance when given; else CFG off (1.0) for a checkpoint whose
    algorithm rolls out CFG-free (NFT, AWM: the regime it trained); else the validation sampling's scale. trained:
    `trained_config(checkpoint)`."""
    from omniroll.config.algorithms import cfg_free_rollout
    from omniroll.evaluation.shapes import eval_sampling

    if flag is not None:
        return float(flag), "--guidance"
    scale = float(eval_sampling(cfg)["guidance_scale"])
    algorithm = (trained.get("trainer") or {}).get("algorithm")
    options = (trained.get("trainer") or {}).get("algorithm_options")
    if algorithm and scale > 1.0 and cfg_free_rollout(algorithm, options):
        return 1.0, (f"the regime {checkpoint} trained in (trainer.algorithm {algorithm} rolls out CFG-free); "
                     f"--guidance {scale:g} for the guided numbers")
    return scale, "the config's validation sampling"


def eval_merge_lora(cfg, checkpoint: Optional[str], trained: dict) -> tuple[bool, str]:
    """(whether a LoRA checkpoint runs merged into the weights, why): `engine.merge_lora` when the config sets it;
    else as the checkpoint's own run drew (its trainer's evaluation is then reproduced picture for picture, merged
    and unmerged pictures agreeing only to rounding); else unmerged. trained: `trained_config(checkpoint)`."""
    if "merge_lora" in cfg.engine.model_fields_set:
        return bool(cfg.engine.merge_lora), "engine.merge_lora"
    merged = bool((trained.get("engine") or {}).get("merge_lora", False))
    return merged, f"as {checkpoint}'s run drew (engine.merge_lora false to unmerge)"


def evaluate_model(cfg, model: str, prompts: list[str], seeds: int, checkpoint: str | None, out_dir: str,
                   progress: bool = False, name: str = "eval", guidance: Optional[float] = None,
                   baseline: Optional[dict] = None, merge_lora: Optional[bool] = None, cache: bool = False) -> dict:
    """Build the engine (with the checkpoint applied), evaluate at `guidance` (default: the validation sampling's),
    write the files; returns the report's dict with `table` (and under it the cache's note), `seconds`, `files`,
    `evaluation` (the pictures) and `cache`. With `baseline` (another call's result at the same prompts and seeds):
    also `paired` and `paired_table`, the flipped pictures framed in the grid and drawn in `flips.png`. `merge_lora`
    (default: the config's `engine.merge_lora`) keeps a LoRA checkpoint merged into the weights. `cache`: a model
    without a checkpoint is read from the evaluation cache when it can be (`omniroll.evaluation.cache.evaluate_kept`;
    `cache` is then its `{"key", "read", "checked", "agreed", "note"}`, else {})."""

    from omniroll.engine.config import EngineConfig, torch_dtype
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.evaluation.cache import EvaluationCache, eligible, evaluate_kept
    from omniroll.evaluation.checkpoints import add_lora_checkpoint, checkpoint_kind, load_full_weights
    from omniroll.evaluation.paired import flips, paired, paired_table
    from omniroll.evaluation.baselines import baseline_table
    from omniroll.evaluation.shapes import eval_sampling, evaluate, flips_picture, write_evaluation
    from omniroll.evaluation.worlds import world_of
    from omniroll.models import load_adapter

    kwargs = cfg.engine.engine_kwargs()
    kwargs["dtype"] = torch_dtype(kwargs["dtype"])
    if merge_lora is not None:
        kwargs["merge_lora"] = merge_lora
    adapter = load_adapter(model, device=kwargs["device"], dtype=kwargs["dtype"])
    kind = checkpoint_kind(checkpoint) if checkpoint is not None else None
    if kind == "full":
        load_full_weights(adapter, checkpoint)
    sampling = eval_sampling(cfg)
    if guidance is not None:
        sampling["guidance_scale"] = float(guidance)
    engine = DiffusionEngine(adapter, EngineConfig(**kwargs))
    task = world_of(model).task
    t0 = time.time()
    kept: dict = {}
    try:
        if kind == "lora":
            add_lora_checkpoint(engine, checkpoint)
        identity = eligible([engine.sample_identity()]) if cache and checkpoint is None else None
        if identity is None:
            ev = evaluate(engine, prompts, seeds, sampling, cfg.val_kwargs.seed, progress=progress, task=task)
        else:
            ev, kept = evaluate_kept(
                EvaluationCache.for_model(model), identity, sampling, prompts, seeds,
                cfg.val_kwargs.seed, lambda indices, n: evaluate(
                    engine, prompts if indices is None else [prompts[i] for i in indices], n, sampling,
                    cfg.val_kwargs.seed, progress=progress and indices is None, task=task))
    finally:
        engine.shutdown()
    seconds = time.time() - t0
    title = (cfg.engine.model + (f" + {checkpoint}" if checkpoint else "")
             + f", guidance {sampling['guidance_scale']:g}")
    extra = {"model": cfg.engine.model, "checkpoint": checkpoint, "seeds": seeds, "sampling": sampling,
             "guidance_scale": sampling["guidance_scale"], "seconds": seconds, **({"cache": kept} if kept else {})}
    flipped, out = None, {}
    if baseline is not None:
        base_pictures = baseline["evaluation"].picture_records()
        cmp = paired(base_pictures, ev.picture_records())
        flipped = flips(base_pictures, ev.picture_records())
        extra.update({"baseline": {"model": baseline["model"], "checkpoint": baseline["checkpoint"],
                                   "guidance_scale": baseline["guidance_scale"], "overall": baseline["overall"],
                                   "categories": baseline["categories"]}, "paired": cmp})
        out = {"paired": cmp, "paired_table": paired_table(
            cmp, baseline, ev.report.to_dict(), f"paired with the baseline ({baseline['title']}): same prompts and "
                                                f"seeds", ev.world.noun)}
    files = write_evaluation(ev, out_dir, name=name, title=title, extra=extra, flipped=flipped)
    if flipped is not None:
        path = flips_picture(baseline["evaluation"], ev, flipped, os.path.join(out_dir, "flips.png"),
                             title=f"{title} vs {baseline['title']}", labels=("base", "new"))
        if path is not None:
            files["flips"] = path
    baselines = ev.baselines()
    table = ev.report.table(f"omniroll eval: {title} ({len(set(prompts))} prompts x {seeds} seeds)") + (
        f"\n{kept['note']}" if kept else "") + (f"\n{baseline_table(baselines, ev.report.to_dict())}" if baselines
                                                else "")
    return {**ev.report.to_dict(), **out, "table": table, "seconds": seconds, "files": files, "evaluation": ev,
            "task": task, "baselines": baselines,
            "cache": kept,
            "model": cfg.engine.model, "checkpoint": checkpoint, "guidance_scale": sampling["guidance_scale"],
            "title": title}
