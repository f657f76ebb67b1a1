"""`omniroll pretrain shapes-video`: the shapes-video model from scratch, in phases, each with a progress bar, each
resumable (`resume.py`: state saved to `<out>/resume/` every `resume_every` steps; a rerun with the same `out`
continues and ends bitwise where an uninterrupted run ends).

1. Train the VAE (single frames, then clips, then clips with object pixels weighted: phases `vae` and
   `vae_foreground`; decoded without the clamp); check it on held-out clips (PSNR, and the moving-shapes checker's
   strict accuracy per category on reconstructions: the ceiling of any generator with it).
2. Encode `dit.num_latents` training clips (two-motion ones placed by `two_motions_layout`) to posterior means;
   their per-channel mean and std become the VAE's `latents_mean` / `latents_std` (saved to `resume/latents.pt`).
3. Embed every training caption and the empty prompt through the Wan adapter's own prompt encoding.
4. Train the transformer (rectified flow, logit-normal t, CFG dropout, EMA).
5. Save a `WanPipeline` checkpoint with the EMA transformer (+ `omniroll_defaults.json`, `recipe.json`,
   `SHA256SUMS`), the loss curves (`loss_curve.png`) and `pretrain.json` (recipe, timings, seconds per step, the VAE
   check).

`vae_from=DIR` takes step 1's VAE from a shapes-video checkpoint trained by the same VAE recipe (its `recipe.json`'s
`vae`, `vae_data_seed` and `category_weights` equal to this recipe's; checked) instead of training it: a change to the
text encoder or the transformer then costs the transformer's hours only. Its check is still run.

`until="vae"` stops after step 1 (the VAE, its check, `pretrain.json` and the curve): judge the VAE's ceiling before
the transformer's hours are spent; a later run without it continues from there.

`snapshot_every=N` also saves the EMA transformer after every N-th step of step 4 as `<out>/snapshots/step_<s>/`, a
whole checkpoint with the recipe at `dit.steps = s` in its `recipe.json`: the rate is constant after warm-up, so it is
bitwise the checkpoint a run of that recipe ends with (refused with `dit.cosine_decay`, where it would not be). A
snapshot is written to a temporary name and renamed; a resumed run writes one its interruption missed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import time
from typing import Callable, Optional

import numpy as np
import torch

from omniroll.models.shipped import write_sums
from omniroll.models.shapes.assemble import save_checkpoint
from omniroll.models.shapes.dit import EMA, optimizer_step
from omniroll.models.shapes.pretrain import plot_losses
from omniroll.models.shapes.vae import lr_at
from omniroll.models.shapes_video.data import TrainingClips
from omniroll.models.shapes_video.progress import progress_bar
from omniroll.models.shapes_video.dit import build_transformer, flow_loss
from omniroll.models.shapes_video.recipe import ShapesVideoRecipe
from omniroll.models.shapes_video.resume import check_recipe, run_phase, save_atomic, step_generator
from omniroll.models.shapes_video.text import TEXT_LENGTH, build_text
from omniroll.models.shapes_video.vae import (build_vae, encode_means, normalise, reconstruct, set_latent_stats,
                                              vae_batch, vae_step)


#: clips drawn (and encoded) at a time: chunk i of the latents is `TrainingClips.batch(latent_data_seed, i, ...)`
LATENT_CHUNK = 32


def assemble(transformer, vae, text: dict, shift: float):
    """A `WanPipeline` of the given modules and a `FlowMatchEulerDiscreteScheduler(shift=shift)`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(transformer=transformer.eval(), vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=shift), **text)


def check_vae(vae, recipe: ShapesVideoRecipe) -> dict:
    """PSNR and the checker's strict accuracy per category on reconstructions of `check_clips` held-out clips (the
    prompts in turn, each clip's seed from `check_seed`)."""
    from omniroll.tasks.moving_shapes.grammar import parse_prompt
    from omniroll.tasks.moving_shapes.judge import score_clip
    from omniroll.tasks.moving_shapes.render import render_prompt
    from omniroll.tasks.moving_shapes.splits import split_prompts

    held = split_prompts("heldout")
    prompts = [held[i % len(held)] for i in range(recipe.check_clips)]
    seeds = np.random.default_rng(recipe.check_seed).integers(0, 2 ** 62, size=len(prompts))
    clips = np.stack([render_prompt(p, int(s)) for p, s in zip(prompts, seeds)])
    rec = reconstruct(vae, clips)
    psnr = float(10 * np.log10(255.0 ** 2 / np.mean((rec.astype(np.float64) - clips) ** 2)))
    by_tag: dict[str, list[bool]] = {}
    for p, clip in zip(prompts, rec):
        spec = parse_prompt(p)
        by_tag.setdefault(spec.tag, []).append(score_clip(spec, clip).strict)
    strict = {t: float(np.mean(v)) for t, v in sorted(by_tag.items())}
    return {"clips": len(prompts), "psnr_db": psnr, "strict": strict,
            "strict_overall": float(np.mean([x for v in by_tag.values() for x in v]))}


def train_vae(vae, recipe: ShapesVideoRecipe, resume: str, progress: bool, on_step) -> list[dict]:
    """Train (or resume training) `vae` in place: `vae.steps` steps of the plain loss (phase `vae`), then
    `vae.foreground_steps` with object pixels weighted (phase `vae_foreground`, the same optimizer continued, its
    steps numbered on from `vae.steps` for their batches and noise); AdamW, the shapes model's warm-up and gradient
    clipping. Returns every step's record (the foreground ones with `"foreground": True`, their steps counted on)."""
    r = recipe.vae
    data = TrainingClips(recipe.category_weights)
    opt = torch.optim.AdamW(vae.parameters(), lr=r.lr, weight_decay=0.0)
    vae.train()

    def step(s: int, foreground: bool = False) -> dict:
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(s, r)
        x = vae_batch(data, r, recipe.vae_data_seed, s)
        loss, parts = vae_step(vae, x, r, step_generator(r.seed, s), foreground)
        rec = optimizer_step(vae, opt, None, loss, s, t0)
        return {**parts, "loss": rec["loss"], "grad_norm": rec["grad_norm"], "seconds": time.time() - t0}

    parts = {"vae": vae, "optimizer": opt}
    hist = phase("vae", r.steps, step, parts, resume, recipe, progress, on_step)
    if r.foreground_steps:
        hist += [{**h, "step": r.steps + h["step"], "foreground": True} for h in phase(
            "vae_foreground", r.foreground_steps, lambda s: step(r.steps + s, foreground=True), parts, resume,
            recipe, progress, on_step)]
    return hist


def phase(name, steps, step_fn, parts, resume, recipe, progress, on_step, on_start=None) -> list[dict]:
    """`run_phase` with a progress bar (the loss as its postfix), the caller's `on_step(phase, step)` and
    `on_start(step)` (the step it starts at)."""
    bar = progress_bar(steps, name, progress)

    def start(s: int) -> None:  # a resumed phase's bar starts where it stopped (its rate counts this run's steps)
        bar.reset(total=steps)
        bar.n = bar.last_print_n = bar.initial = s
        bar.refresh()
        if on_start is not None:
            on_start(s)

    def after(s: int, rec: dict) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.4f}")
        if on_step is not None:
            on_step(name, s)

    try:
        return run_phase(name, steps, step_fn, parts, resume, recipe.resume_every, after, start)
    finally:
        bar.close()


def encode_latents(vae, recipe: ShapesVideoRecipe, resume: str, progress: bool) -> tuple[list[str], torch.Tensor]:
    """(captions, posterior means [N, C, t, h, w]) of `dit.num_latents` training clips, cached in resume/latents.pt."""
    path = os.path.join(resume, "latents.pt")
    if os.path.isfile(path):
        saved = torch.load(path, weights_only=True)
        return list(saved["captions"]), saved["means"]
    data = TrainingClips(recipe.category_weights, two_motions_layout=recipe.two_motions_layout)
    chunk, n = LATENT_CHUNK, recipe.dit.num_latents
    caps, means = [], []
    bar = progress_bar(n, "latents", progress, unit="clip")
    for i, start in enumerate(range(0, n, chunk)):
        c, clips = data.batch(recipe.latent_data_seed, i, min(chunk, n - start))
        caps += c
        means.append(encode_means(vae, clips))
        bar.update(len(c))
    bar.close()
    means = torch.cat(means)
    save_atomic({"captions": caps, "means": means}, path)
    return caps, means


def caption_embeddings(pipeline, caps: list[str]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(prompt embeds [P, L, D], caption ids [N], the empty prompt's index) through the Wan adapter's encoding."""
    from omniroll.models.wan import WanAdapter

    prompts = sorted(set(caps)) + [""]
    embeds = torch.stack([c.tensors["prompt_embeds"] for c in WanAdapter(pipeline).encode_prompts(prompts,
                                                                                                  TEXT_LENGTH)])
    index = {p: i for i, p in enumerate(prompts)}
    return embeds, torch.tensor([index[c] for c in caps]), index[""]


def save_model(transformer, vae, text: dict, recipe: ShapesVideoRecipe, path: str) -> str:
    """The pipeline as a checkpoint directory with its sampling defaults, `recipe.json` and `SHA256SUMS`."""
    save_checkpoint(assemble(transformer, vae, text, recipe.sampling.shift), path, recipe.sampling_defaults())
    with open(os.path.join(path, "recipe.json"), "w") as f:
        json.dump(recipe.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    write_sums(path)
    return path


def save_snapshot(transformer, vae, text: dict, recipe: ShapesVideoRecipe, step: int, out_dir: str) -> str:
    """`transformer` after `step` steps saved as `<out_dir>/snapshots/step_<step>/` with the recipe at `dit.steps =
    step` (module doc), through a temporary directory renamed into place; returns its path."""
    path = os.path.join(out_dir, "snapshots", f"step_{step}")
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    as_run = dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, steps=step))
    save_model(transformer, vae, text, as_run, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def saved_snapshots(out_dir: str) -> list[str]:
    """The snapshot directories under `<out_dir>/snapshots/`, by step."""
    root = os.path.join(out_dir, "snapshots")
    names = [n for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()] if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]))]


#: where a run may stop: after the VAE and its check (judge the ceiling before the transformer's hours), or at the end
UNTIL = ("vae", "checkpoint")


def load_vae(path: str, recipe: ShapesVideoRecipe):
    """The VAE of the shapes-video checkpoint directory `path`, after checking that `recipe` would train the same one
    (ValueError naming the fields that differ, or the missing file)."""
    from diffusers import AutoencoderKLWan

    file = os.path.join(path, "recipe.json")
    if not os.path.isfile(file):
        raise ValueError(f"vae_from: {file} not found (a shapes-video checkpoint directory has one)")
    with open(file) as f:
        theirs = ShapesVideoRecipe.from_dict(json.load(f))
    differ = [k for k in ("vae", "vae_data_seed", "category_weights") if getattr(theirs, k) != getattr(recipe, k)]
    if differ:
        raise ValueError(f"vae_from: {path} was trained by another VAE recipe ({differ} differ from this one's)")
    from safetensors.torch import load_file

    # from its config and weights, not `from_pretrained`: that records the local path in the config it saves
    vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(os.path.join(path, "vae"))).to(torch.float32)
    vae.load_state_dict(load_file(os.path.join(path, "vae", "diffusion_pytorch_model.safetensors")), strict=True)
    return vae


def pretrain(recipe: ShapesVideoRecipe, out_dir: str, progress: bool = True, log: Callable[[str], None] = print,
             on_step: Optional[Callable[[str, int], None]] = None, until: str = "checkpoint",
             vae_from: Optional[str] = None, snapshot_every: int = 0) -> dict:
    """Run (or resume) the recipe into `out_dir` (see the module doc) up to `until` (`UNTIL`), the VAE trained or
    taken from the checkpoint `vae_from`, the EMA transformer saved every `snapshot_every` steps (0: never); returns
    the `pretrain.json` record. `on_step(phase, step)` runs after each step's state (and snapshot) is safe (an
    exception it raises interrupts the run resumably)."""
    if until not in UNTIL:
        raise ValueError(f"until must be one of {list(UNTIL)}, got {until!r}")
    recipe.check()
    if snapshot_every < 0:
        raise ValueError(f"snapshot_every must be >= 0 steps, got {snapshot_every}")
    if snapshot_every and recipe.dit.cosine_decay:
        raise ValueError("snapshot_every: with dit.cosine_decay the rate at step N depends on dit.steps, so a snapshot "
                         "would not be the checkpoint of a run with dit.steps=N; snapshots need a constant rate")
    vae = None if vae_from is None else load_vae(vae_from, recipe)
    resume = os.path.join(out_dir, "resume")
    # a run from another VAE must not resume this one (nor the reverse)
    check_recipe(resume, recipe.to_dict() if vae_from is None else {**recipe.to_dict(),
                                                                    "vae_from": os.path.abspath(vae_from)},
                 written_before={"two_motions_layout": "any"})  # a run of 0.3.39 or before: the world's layout
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.torch_threads)
    times, t_start = {}, time.time()
    try:
        # 1. the VAE and its check
        t0 = time.time()
        if vae is None:
            vae = build_vae(recipe.vae)
            vae_hist = train_vae(vae, recipe, resume, progress, on_step)
        else:
            vae_hist = []
        vae.eval()
        times["vae_s"] = time.time() - t0
        t0 = time.time()
        vae_check = cached_json(os.path.join(resume, "vae_check.json"), lambda: check_vae(vae, recipe))
        times["vae_check_s"] = time.time() - t0
        log(f"vae: PSNR {vae_check['psnr_db']:.1f} dB, checker on held-out reconstructions "
            f"{100 * vae_check['strict_overall']:.1f} % " + str({k: round(100 * v, 1)
                                                                for k, v in vae_check["strict"].items()}))
        record = {"recipe": recipe.to_dict(), "until": until, "checkpoint": None, "times": times, "vae_from": vae_from,
                  "vae_check": vae_check, "params": {"vae": sum(p.numel() for p in vae.parameters())}}
        if until == "vae":
            return write_record(record, out_dir, recipe, t_start, vae_hist, [])

        # 2. latents, 3. caption embeddings
        t0 = time.time()
        caps, means = encode_latents(vae, recipe, resume, progress)
        set_latent_stats(vae, means)
        latents = normalise(vae, means)
        text = build_text(recipe.text)
        transformer = build_transformer(recipe.dit, recipe.vae.z_dim, recipe.text.d_model)
        embeds, caption_ids, empty = caption_embeddings(assemble(transformer, vae, text, recipe.sampling.shift), caps)
        times["latents_s"] = time.time() - t0

        # 4. the transformer
        t0 = time.time()
        r = recipe.dit
        opt = torch.optim.AdamW(transformer.parameters(), lr=r.lr, weight_decay=r.weight_decay)
        ema = EMA(transformer, r.ema_decay)
        transformer.train()

        def dit_step(s: int) -> dict:
            t1 = time.time()
            for group in opt.param_groups:
                group["lr"] = lr_at(s, r)
            loss = flow_loss(transformer, r, latents, caption_ids, embeds, empty, step_generator(r.seed, s))
            rec = optimizer_step(transformer, opt, ema, loss, s, t1)
            return {"loss": rec["loss"], "grad_norm": rec["grad_norm"], "seconds": time.time() - t1}

        def snapshot(s: int) -> None:  # after step s, and at a resumed start (an interruption may have missed it)
            want = snapshot_every and s % snapshot_every == 0 and 0 < s < r.steps
            if want and not os.path.isdir(os.path.join(out_dir, "snapshots", f"step_{s}")):
                save_snapshot(ema.module, vae, text, recipe, s, out_dir)

        def after_dit(name: str, s: int) -> None:
            snapshot(s)
            if on_step is not None:
                on_step(name, s)

        dit_hist = phase("transformer", r.steps, dit_step, {"transformer": transformer, "optimizer": opt, "ema": ema},
                         resume, recipe, progress, after_dit, on_start=snapshot)
        transformer.eval()
        times["transformer_s"] = time.time() - t0

        # 5. the checkpoint, the curves, the record
        record["checkpoint"] = save_model(ema.module, vae, text, recipe, os.path.join(out_dir, "checkpoint"))
        record["snapshots"] = saved_snapshots(out_dir)
        record["params"].update(transformer=sum(p.numel() for p in transformer.parameters()),
                                text_encoder=sum(p.numel() for p in text["text_encoder"].parameters()))
        return write_record(record, out_dir, recipe, t_start, vae_hist, dit_hist)
    finally:
        torch.set_num_threads(threads)


def cached_json(path: str, compute: Callable[[], dict]) -> dict:
    """The JSON at `path`, or `compute()` written there (a resumed run does not redo a finished check)."""
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    value = compute()
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2)
    os.replace(path + ".tmp", path)
    return value


def write_record(record: dict, out_dir: str, recipe: ShapesVideoRecipe, t_start: float, vae_hist: list[dict],
                 dit_hist: list[dict]) -> dict:
    """Complete `record` (this run's total time; the steps' seconds over every run, resumed ones included; the last
    100 steps' mean losses; the machine), write it as `pretrain.json` and the loss curves as `loss_curve.png`;
    returns it."""
    v = recipe.vae
    plot_losses([(vae_hist, f"VAE: frames to step {v.image_steps}, then clips;\nfrom step {v.steps} object "
                            f"pixels x{v.foreground_weight:g}"),
                 (dit_hist, "transformer (flow)")], os.path.join(out_dir, "loss_curve.png"),
                title="omniroll pretrain shapes-video: training losses")
    record["times"]["total_s"] = time.time() - t_start
    record["steps_seconds_all_runs"] = {"vae": float(sum(h.get("seconds", 0.0) for h in vae_hist)),
                                        "transformer": float(sum(h["seconds"] for h in dit_hist))}
    record["seconds_per_step"] = seconds_per_step(vae_hist, recipe.vae.image_steps, recipe.vae.steps, dit_hist)
    record["final_loss"] = {name: float(np.mean([h["loss"] for h in hist[-100:]]))
                            for name, hist in (("vae", vae_hist), ("transformer", dit_hist)) if hist}
    record["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "threads": recipe.torch_threads, "load_average": list(os.getloadavg())}
    with open(os.path.join(out_dir, "pretrain.json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return record


def seconds_per_step(vae_hist: list[dict], image_steps: int, vae_steps: int, dit_hist: list[dict]) -> dict:
    """Median seconds of a VAE image step, clip step and foreground clip step, and of a transformer step (None
    where none ran; records without seconds are skipped)."""
    def median(hist):
        seconds = [h["seconds"] for h in hist if "seconds" in h]
        return float(np.median(seconds)) if seconds else None

    return {"vae_image": median(vae_hist[:image_steps]), "vae_clip": median(vae_hist[image_steps:vae_steps]),
            "vae_foreground": median(vae_hist[vae_steps:]), "transformer": median(dit_hist)}
