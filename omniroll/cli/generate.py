"""`omniroll generate`: images or videos with SDE log-probs on one in-process engine.

Writes into `--out`: `prompt_NNN.png` (one row of that prompt's samples; video: `prompt_NNN_sJ.mp4`, or `.webp`
without an H.264 encoder, and `prompt_NNN_sJ_frames.png` per sample, `video_format` saying which),
`trajectories.safetensors` (the layout of `omniroll.trajectory_file`, the same as `omniroll rollout` writes) and
`metrics.json` (timing, run: model, device, dtype, batch invariance, seeds, package versions). Finished samples are
written even when the run is interrupted (Ctrl-C, exit 130) or some samples fail (each failure is reported once,
exit 1).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omniroll.cli.common import (add_config_arguments, add_prompt_arguments, build_config, preflight,
                                 quiet_libraries, read_prompts, sample_seed)

HELP = "generate images with SDE log-probs on one in-process engine"


def add_arguments(parser) -> None:
    add_prompt_arguments(parser)
    add_config_arguments(parser, config_help="optional YAML config (its engine, pipeline, algo, n and seed sections "
                                             "are used; see examples/rollout.yaml); flags override it")
    parser.add_argument("--out", default="out/generate", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    result = run_generate(args)
    keys = ("num_images", "seconds", "images_per_second") + (("video_format",) if result["video_format"] else ())
    print(json.dumps({k: result[k] for k in keys}))
    print_files(result)
    return 1 if result["failed_rows"] else 0


def print_files(result: dict) -> None:
    print(f"wrote {len(result['files'])} files:")
    for f in result["files"]:
        print(f"  {f}")


def save_grid(images, path: Path, caption: str = "") -> str:
    """images: uint8 tensor [N, 3, H, W] -> one PNG (0644): the samples side by side on white, a gap between them,
    and a caption line above (the prompt). The pixels of each sample are exactly the recorded ones."""
    import io

    from PIL import Image, ImageDraw

    from omniroll.files import write_bytes

    n, _, h, w = images.shape
    gap, top = 4, 16 if caption else 0
    sheet = Image.new("RGB", (n * w + (n + 1) * gap, h + 2 * gap + top), "white")
    for k in range(n):
        sheet.paste(Image.fromarray(images[k].permute(1, 2, 0).numpy()), (gap + k * (w + gap), gap + top))
    if caption:
        ImageDraw.Draw(sheet).text((gap, 2), caption, fill=(40, 40, 40))
    buf = io.BytesIO()
    sheet.save(buf, format="PNG")
    return write_bytes(str(path), buf.getvalue())


def run_generate(args, base: dict | None = None) -> dict:
    """Validate everything, then generate. Returns the metrics (plus `files`); raises KeyboardInterrupt after writing
    what finished when interrupted."""
    cfg = build_config(args, base)
    prompts = read_prompts(args)
    if args.quiet:
        quiet_libraries()
    model = preflight(cfg, prompts)

    import asyncio

    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.rollout.replica import resolve_engine_kwargs
    from omniroll.sampling.seeds import derive_group_seed
    from omniroll.agent_loop.batch import command_batch
    from omniroll.agent_loop.rows import tree_fields
    from omniroll.sampling.seeds import CLI_GLOBAL_STEP

    sp = cfg.sampling_params()
    batch = command_batch(prompts, cfg.n, rollout_seed=cfg.seed)
    nt = batch.non_tensor_batch
    requests = []
    for r in range(len(batch)):
        uid, j = nt["uid"][r], int(nt["_group_index"][r])
        row_sp, seed = dict(sp), sample_seed(cfg.seed, uid, j)
        if cfg.algo.same_latent or cfg.algo.tree is not None:
            row_sp["latent_seed"] = derive_group_seed(cfg.seed, CLI_GLOBAL_STEP, uid)
        if cfg.algo.tree is not None:  # leaf j of its prompt's tree, as the agent loop makes it
            leaf = tree_fields(cfg.algo.tree, cfg.seed, CLI_GLOBAL_STEP, uid, j, r)
            row_sp["noise_seeds"], seed = leaf["noise_seeds"], leaf["seed"]
        requests.append(GenerationRequest(request_id=f"gen/{uid}/{j}", prompt=nt["raw_prompt"][r],
                                          sampling_params=SamplingParams.model_validate(row_sp), seed=seed))
    engine = DiffusionEngine.from_pretrained(model, **resolve_engine_kwargs(cfg.engine.engine_kwargs()))
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    t0 = time.perf_counter()
    interrupted = False
    try:
        asyncio.run(_generate_all(engine, requests, results, errors, progress=not args.quiet))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        seconds = time.perf_counter() - t0
        stats = engine.stats()
        engine.shutdown()
    metrics = write_generate_outputs(args.out, cfg, model, prompts, batch, requests, results, errors, seconds, stats,
                            batch_invariant=engine.config.batch_invariant, interrupted=interrupted)
    for r, err in sorted(errors.items()):
        print(f"omniroll generate: row {r} ({requests[r].request_id}) failed: {err}", file=sys.stderr)
    if interrupted:
        print(f"omniroll generate: interrupted; wrote the {len(results)} of {len(requests)} samples that finished "
              f"to {args.out}", file=sys.stderr)
        raise KeyboardInterrupt
    return metrics


async def _generate_all(engine, requests, results: dict, errors: dict, progress: bool) -> None:
    """Every request concurrently; each finished output lands in `results` at once (so an interrupt keeps it)."""
    import asyncio

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="generate", unit="img", file=sys.stderr)

    async def one(i, request):
        try:
            out = await engine.generate_async(request)
            if out.stop_reason == "completed":
                results[i] = out
            else:
                errors[i] = f"stopped: {out.stop_reason}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported once per row, the others go on
            errors[i] = f"{type(e).__name__}: {e}"
        finally:
            if bar is not None:
                bar.update(1)

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        if bar is not None:
            bar.close()


def write_generate_outputs(out_dir, cfg, model, prompts, batch, requests, results, errors, seconds, stats, *,
                           batch_invariant: bool, interrupted: bool) -> dict:
    """Write the finished samples (grids, trajectories, metrics); returns the metrics."""
    import torch

    from omniroll.media import video_encoder
    from omniroll.files import jsonable, run_info, write_json
    from omniroll.trajectory_file import FILE_NAME, batch_from_outputs, write_trajectories

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = sorted(results)
    files = []
    run = run_info("generate", model, cfg.engine.device, cfg.engine.dtype, batch_invariant, cfg.seed,
                   num_threads=cfg.engine.num_threads)
    log_probs = None
    if done:
        traj = batch_from_outputs([results[r] for r in done], prompts, cfg.n, rows=done,
                                  prompt_length=cfg.prompt_length, max_prompt_embed_length=cfg.max_prompt_embed_length,
                                  meta_info=batch.meta_info)
        images = traj.batch["responses"]
        if images.dtype == torch.uint8 and images.ndim == 5:  # video: a file and a frame strip per sample
            from omniroll.media import save_sample

            for k, r in enumerate(done):
                stem = out / f"prompt_{r // cfg.n:03d}_s{r % cfg.n}"
                files += [str(f) for f in save_sample(images[k], stem, fps=cfg.pipeline.fps)]
        elif images.dtype == torch.uint8:
            by_prompt: dict[int, list[int]] = {}
            for k, r in enumerate(done):
                by_prompt.setdefault(r // cfg.n, []).append(k)
            tiny = "" if cfg.engine.model != "tiny" else "  (tiny model, random weights: noise-like by design)"
            for i, ks in sorted(by_prompt.items()):
                files.append(save_grid(images[ks], out / f"prompt_{i:03d}.png", prompts[i][:80] + tiny))
        files.append(write_trajectories(traj, str(out / FILE_NAME), run))
        if "rollout_log_probs" in traj.batch.keys():
            log_probs = traj.batch["rollout_log_probs"]
    metrics = {
        "num_images": len(done),
        "num_requested": len(requests),
        "seconds": seconds,
        "images_per_second": len(done) / seconds if seconds > 0 else None,
        "mean_log_prob": float(log_probs.mean()) if log_probs is not None and log_probs.numel() else None,
        "interrupted": interrupted,
        "failed_rows": [{"row": r, "request_id": requests[r].request_id, "error": e}
                        for r, e in sorted(errors.items())],
        "seeds": [requests[r].seed for r in range(len(requests))],
        "prompts": prompts,
        "sde_window": [list(results[r].extra_fields["sde_window"]) for r in done],
        "video_format": video_encoder() if cfg.pipeline.num_frames > 1 else None,
        "sampling_params": cfg.sampling_params(),
        "run": run,
        "engine": stats,
    }
    files.append(str(out / "metrics.json"))
    metrics["files"] = [str(Path(f).resolve()) for f in files]
    write_json(str(out / "metrics.json"), jsonable(metrics))
    return metrics
