"""`omniroll pretrain shapes`: the shapes model from scratch, in five steps, each with a progress bar.

1. Train the VAE on pictures of the world; check it on held-out pictures (PSNR, and the checker's accuracy on
   reconstructions: the ceiling any generator with this VAE can reach).
2. Encode `dit.num_latents` captioned pictures to normalised latents (the VAE's shift and scale set to mean 0, std 1).
3. Embed every training caption and the empty prompt with the frozen text encoders, through the SD3 adapter's own
   prompt encoding (what the engine will feed the transformer).
4. Train the transformer (rectified flow, CFG dropout, EMA).
5. With `distill.steps` > 0, distil its guidance (`distill.py`): the EMA transformer is the teacher, and the student
   draws CFG-free what it drew at CFG `distill.guidance`.
6. Save the pipeline with the EMA transformer (the student's, when distilled) as a diffusers checkpoint (+ sampling
   defaults, `recipe.json`, `SHA256SUMS`), the loss curves (`loss_curve.png`), and `pretrain.json` (recipe, timings,
   the VAE check and what `evaluate` returns: the CLI passes the GenEval-style evaluation of
   `omniroll.evaluation.shapes`).

`distill_checkpoint` runs step 5 alone on an existing checkpoint (`omniroll pretrain shapes --from shapes --distill N`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Callable, Optional

import numpy as np
import torch

from omniroll.models.shipped import write_sums
from omniroll.models.shapes.assemble import assemble_pipeline, save_checkpoint
from omniroll.models.shapes.data import CaptionedScenes, to_unit_range
from omniroll.models.shapes.dit import build_transformer, train_transformer
from omniroll.models.shapes.distill import distill_transformer
from omniroll.models.shapes.recipe import ShapesRecipe
from omniroll.models.shapes.text import TEXT_LENGTH, build_text_stack, joint_attention_dim, pooled_dim
from omniroll.models.shapes.vae import build_vae, reconstruct, train_vae


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=not enabled)


def check_vae(vae, recipe: ShapesRecipe) -> dict:
    """PSNR and the checker's strict accuracy per category on reconstructions of held-out pictures."""
    from omniroll.tasks.shapes.report import Report, score_pictures

    data = CaptionedScenes(recipe.vae_data_seed + 1000, weights=recipe.category_weights)
    caps, pics = data.batch(recipe.check_pictures)
    rec = reconstruct(vae, pics)
    psnr = float(10 * np.log10(255.0 ** 2 / np.mean((rec.astype(np.float64) - pics) ** 2)))
    report = Report.from_rows(score_pictures(caps, list(rec)))
    return {"psnr_db": psnr, "checker_on_reconstructions": report.to_dict()}


def encode_pictures(vae, recipe: ShapesRecipe, progress: bool, n: int) -> tuple[list[str], torch.Tensor]:
    """(captions, the VAE's latents [N, C, h, w], not normalised) of `n` captioned pictures of the world."""
    data = CaptionedScenes(recipe.latent_data_seed, weights=recipe.category_weights)
    chunk = 512
    caps, zs = [], []
    bar = _bar(n, "latents", progress)
    with torch.no_grad():
        for i in range(0, n, chunk):
            c, pics = data.batch(min(chunk, n - i))
            caps += c
            zs.append(vae.encode(to_unit_range(pics)).latent_dist.mean)
            bar.update(len(c))
    bar.close()
    return caps, torch.cat(zs)


def encode_latents(vae, recipe: ShapesRecipe, progress: bool) -> tuple[list[str], torch.Tensor, float, float]:
    """(captions, normalised latents [N, C, h, w], shift, scale) of `dit.num_latents` pictures: the shift and scale
    that make them mean 0, std 1 (the VAE keeps them in its config)."""
    caps, z = encode_pictures(vae, recipe, progress, recipe.dit.num_latents)
    shift, scale = float(z.double().mean()), float(1.0 / z.double().std())
    return caps, ((z - shift) * scale).float(), shift, scale


def caption_embeddings(pipeline, caps: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(prompt embeds [P, L, D], pooled [P, D], caption ids [N], the empty prompt's index): every caption and the
    empty prompt through the SD3 adapter's own prompt encoding (what the engine feeds the transformer)."""
    from omniroll.models.sd3 import SD3Adapter

    prompts = sorted(set(caps)) + [""]
    conds = SD3Adapter(pipeline).encode_prompts(prompts, TEXT_LENGTH)
    embeds = torch.stack([c.tensors["prompt_embeds"] for c in conds])
    pooled = torch.stack([c.tensors["pooled_prompt_embeds"] for c in conds])
    index = {p: i for i, p in enumerate(prompts)}
    return embeds, pooled, torch.tensor([index[c] for c in caps]), index[""]


def plot_losses(panels: list[tuple[list[dict], str]], path: str,
                title: str = "omniroll pretrain shapes: training losses") -> None:
    """loss_curve.png: one panel per (history, name) with a history (the VAE, the transformer, the distillation);
    a record's x is its `step` (its place in the history without one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs, k=50):
        xs = np.asarray(xs, dtype=np.float64)
        return np.convolve(xs, np.ones(k) / k, mode="valid") if len(xs) > k else xs

    panels = [(hist, name) for hist, name in panels if hist]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (hist, name) in zip(axes[0], panels):
        loss = [h["loss"] for h in hist]
        x = np.array([h.get("step", i + 1) for i, h in enumerate(hist)])
        ax.plot(x, loss, color="0.8", lw=0.6, label="per step")
        s = smooth(loss)
        ax.plot(x[len(x) - len(s):], s, color="C0", lw=1.5, label="mean of 50")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_model(transformer, vae, text: dict, recipe: ShapesRecipe, path: str) -> str:
    """The pipeline as a checkpoint directory with its sampling defaults, `recipe.json` and `SHA256SUMS`."""
    save_checkpoint(assemble_pipeline(transformer, vae, text, recipe.sampling.shift), path, recipe.sampling_defaults())
    with open(os.path.join(path, "recipe.json"), "w") as f:
        json.dump(recipe.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    write_sums(path)
    return path


def pretrain(recipe: ShapesRecipe, out_dir: str, evaluate: Optional[Callable[[str], dict]] = None,
             progress: bool = True, log: Callable[[str], None] = print, snapshot_every: int = 0) -> dict:
    """Run the recipe into `out_dir` (see the module doc); returns the `pretrain.json` record. `evaluate(path)`
    scores a saved checkpoint (optional). `snapshot_every` > 0 also saves the EMA transformer every that many steps
    as `snapshots/step_N/` (a whole checkpoint: the transformer's learning rate is constant after warm-up, so it is
    exactly what this recipe with `dit.steps = N` makes) and evaluates it, timing it apart from the training."""
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.torch_threads)
    times, t_start = {}, time.time()
    try:
        # 1. the VAE
        t0 = time.time()
        vae = build_vae(recipe.vae, sample_size=64)
        bar = _bar(recipe.vae.steps, "vae", progress)
        vae_hist = train_vae(vae, recipe.vae, CaptionedScenes(recipe.vae_data_seed, weights=recipe.category_weights),
                             on_step=lambda s, h: (bar.update(1), bar.set_postfix(loss=f"{h['loss']:.4f}")))
        bar.close()
        vae_check = check_vae(vae, recipe)
        times["vae_s"] = time.time() - t0
        log(f"vae: {recipe.vae.steps} steps in {times['vae_s']:.0f} s; PSNR {vae_check['psnr_db']:.1f} dB, checker on "
            f"reconstructions {100 * vae_check['checker_on_reconstructions']['overall']['strict']:.1f} %")

        # 2. latents, 3. caption embeddings
        t0 = time.time()
        caps, latents, shift, scale = encode_latents(vae, recipe, progress)
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        text = build_text_stack(recipe.text)
        transformer = build_transformer(recipe.dit, recipe.vae.latent_channels, 64 // recipe.vae.scale_factor,
                                        joint_attention_dim(recipe.text), pooled_dim(recipe.text))
        embeds, pooled, caption_ids, empty = caption_embeddings(
            assemble_pipeline(transformer, vae, text, recipe.sampling.shift), caps)
        times["latents_s"] = time.time() - t0

        # 4. the transformer (snapshots, if asked for, are saved and evaluated off the clock)
        t0 = time.time()
        bar = _bar(recipe.dit.steps, "transformer", progress)
        snapshots, snapshot_s = [], 0.0

        def on_step(step: int, rec: dict, ema) -> None:
            nonlocal snapshot_s
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}")
            if snapshot_every and step % snapshot_every == 0 and step < recipe.dit.steps:
                t_snap = time.time()
                as_run = dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, steps=step))
                path = save_model(ema.module, vae, text, as_run, os.path.join(out_dir, "snapshots", f"step_{step}"))
                snap = {"step": step, "path": path, "seconds": time.time() - t0 - snapshot_s}
                if evaluate is not None:
                    snap["evaluation"] = evaluate(path)
                snapshots.append(snap)
                snapshot_s += time.time() - t_snap

        ema, dit_hist = train_transformer(transformer, recipe.dit, latents, caption_ids, embeds, pooled, empty,
                                          on_step=on_step)
        bar.close()
        times["transformer_s"] = time.time() - t0 - snapshot_s
        times["snapshots_s"] = snapshot_s

        # 5. the guidance distillation (distill.steps > 0): the EMA transformer is the teacher
        final, distill_hist = ema.module, []
        if recipe.distill.steps > 0:
            t0 = time.time()
            final, distill_hist = run_distillation(ema.module, recipe, latents, caption_ids, embeds, pooled, empty,
                                                   progress)
            times["distill_s"] = time.time() - t0

        # 6. the checkpoint, the curves, the record
        ckpt = save_model(final, vae, text, recipe, os.path.join(out_dir, "checkpoint"))
        plot_losses([(vae_hist, "VAE (L1 + MSE + KL)"), (dit_hist, "transformer (flow)"),
                     (distill_hist, "guidance distillation")], os.path.join(out_dir, "loss_curve.png"))
        times["train_total_s"] = time.time() - t_start - snapshot_s
        record = {
            "recipe": recipe.to_dict(), "checkpoint": ckpt, "times": times, "vae_check": vae_check,
            "snapshots": snapshots,
            "final_loss": {"vae": float(np.mean([h["loss"] for h in vae_hist[-100:]])),
                           "transformer": float(np.mean([h["loss"] for h in dit_hist[-100:]])),
                           **distill_loss(distill_hist)},
            "params": {"transformer": sum(p.numel() for p in transformer.parameters()),
                       "vae": sum(p.numel() for p in vae.parameters())}}
        return finish(record, recipe, out_dir, ckpt, times, evaluate)
    finally:
        torch.set_num_threads(threads)


def distill_checkpoint(recipe: ShapesRecipe, source: str, out_dir: str,
                       evaluate: Optional[Callable[[str], dict]] = None, progress: bool = True,
                       log: Callable[[str], None] = print) -> dict:
    """The guidance distillation alone, from the checkpoint at `source` (its VAE, text encoders and transformer:
    steps 1 and 4 of the module doc are skipped): `distill.num_latents` pictures encoded with its VAE, the
    transformer distilled, the checkpoint saved with guidance 1.0 as its default; returns the `pretrain.json` record
    (with `source`)."""
    from diffusers import StableDiffusion3Pipeline

    if recipe.distill.steps < 1:
        raise ValueError(f"distill.steps: distilling a checkpoint needs at least 1 step, got {recipe.distill.steps}")
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.torch_threads)
    times, t_start = {}, time.time()
    try:
        # 1. the source's modules; its VAE's latents of the world's pictures; the caption embeddings
        pipe = StableDiffusion3Pipeline.from_pretrained(source)
        vae, teacher = pipe.vae.eval(), pipe.transformer
        text = {k: getattr(pipe, k) for k in ("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder",
                                              "text_encoder_2", "text_encoder_3")}
        caps, z = encode_pictures(vae, recipe, progress, recipe.distill.num_latents)
        latents = ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()  # as the source was trained
        embeds, pooled, caption_ids, empty = caption_embeddings(pipe, caps)
        times["latents_s"] = time.time() - t_start

        # 2. the distillation
        t0 = time.time()
        final, hist = run_distillation(teacher, recipe, latents, caption_ids, embeds, pooled, empty, progress)
        times["distill_s"] = time.time() - t0
        log(f"distillation: {recipe.distill.steps} steps in {times['distill_s']:.0f} s")

        # 3. the checkpoint, the curve, the record
        ckpt = save_model(final, vae, text, recipe, os.path.join(out_dir, "checkpoint"))
        plot_losses([(hist, "guidance distillation")], os.path.join(out_dir, "loss_curve.png"))
        times["train_total_s"] = time.time() - t_start
        record = {"recipe": recipe.to_dict(), "source": os.path.abspath(source), "checkpoint": ckpt, "times": times,
                  "final_loss": distill_loss(hist),
                  "params": {"transformer": sum(p.numel() for p in final.parameters())}}
        return finish(record, recipe, out_dir, ckpt, times, evaluate)
    finally:
        torch.set_num_threads(threads)


def run_distillation(teacher, recipe: ShapesRecipe, latents, caption_ids, embeds, pooled, empty: int,
                     progress: bool):
    """(the distilled EMA transformer, its history), with a progress bar."""
    bar = _bar(recipe.distill.steps, "distillation", progress)
    ema, hist = distill_transformer(teacher, recipe.distill, latents, caption_ids, embeds, pooled, empty,
                                    on_step=lambda s, h, e: (bar.update(1), bar.set_postfix(loss=f"{h['loss']:.4f}")))
    bar.close()
    return ema.module, hist


def distill_loss(hist: list[dict]) -> dict:
    return {"distill": float(np.mean([h["loss"] for h in hist[-100:]]))} if hist else {}


def finish(record: dict, recipe: ShapesRecipe, out_dir: str, ckpt: str, times: dict,
           evaluate: Optional[Callable[[str], dict]]) -> dict:
    """The machine, the evaluation (if any) and `pretrain.json`; returns the record."""
    record["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "threads": recipe.torch_threads}
    if evaluate is not None:
        t0 = time.time()
        record["evaluation"] = evaluate(ckpt)
        times["evaluation_s"] = time.time() - t0
    with open(os.path.join(out_dir, "pretrain.json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return record
