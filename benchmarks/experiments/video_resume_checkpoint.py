"""Experiment helper: the checkpoint a shapes-video pretraining run would save now, from its resume state mid-run.

`omniroll pretrain shapes-video` saves its state every `resume_every` steps to `OUT/resume/` (`resume.py`); the
checkpoint is written only at the end. To judge a long transformer phase while it runs (or after stopping it), this
builds the checkpoint from that state: the EMA transformer of `OUT/resume/transformer.pt` at the step it was saved,
the VAE (the run's own from its last phase's state, or its `--vae-from` checkpoint's), the latent statistics of
`latents.pt`, the recipe's text encoder, saved by the run's own `save_model` as `DEST` (ready for
`omniroll eval --model DEST`). The transformer's rate is constant after warm-up (the recipe's `cosine_decay` false),
so the checkpoint at step N is what the recipe makes with `dit.steps=N` (on a finished `--toy` run, every file of
the run's own checkpoint byte for byte). Reads the state; never writes to `OUT`.

    .venv/bin/python benchmarks/experiments/video_resume_checkpoint.py out/s82/dit6x160 out/s82/dit6x160-step3000

Ends with one JSON line (the step, the transformer's parameters, the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from omniroll.models.shapes_video.dit import build_transformer
from omniroll.models.shapes_video.pretrain import assemble, caption_embeddings, load_vae, save_model
from omniroll.models.shapes_video.recipe import ShapesVideoRecipe
from omniroll.models.shapes_video.text import build_text
from omniroll.models.shapes_video.vae import build_vae, set_latent_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="the pretraining run's output directory (the --out of omniroll pretrain)")
    ap.add_argument("dest", help="where to write the checkpoint (must not exist)")
    args = ap.parse_args()
    resume = os.path.join(args.run, "resume")
    if os.path.exists(args.dest):
        raise SystemExit(f"{args.dest} exists: give a new directory")
    for name in ("recipe.json", "latents.pt", "transformer.pt"):
        if not os.path.isfile(os.path.join(resume, name)):
            raise SystemExit(f"{resume}/{name} not found: the run has not saved a transformer step yet")
    with open(os.path.join(resume, "recipe.json")) as f:
        saved = json.load(f)
    vae_from = saved.pop("vae_from", None)
    recipe = ShapesVideoRecipe.from_dict(saved)

    # 1. the VAE: the --vae-from checkpoint's, or the run's own at the end of its last phase
    if vae_from is not None:
        vae = load_vae(vae_from, recipe)
    else:
        vae = build_vae(recipe.vae)
        last = "vae_foreground.pt" if recipe.vae.foreground_steps else "vae.pt"
        vae.load_state_dict(torch.load(os.path.join(resume, last), weights_only=True)["parts"]["vae"])
    vae.eval()
    set_latent_stats(vae, torch.load(os.path.join(resume, "latents.pt"), weights_only=True)["means"])

    # 2. the EMA transformer at the saved step, 3. the recipe's text encoder, 4. the checkpoint
    state = torch.load(os.path.join(resume, "transformer.pt"), weights_only=True)
    transformer = build_transformer(recipe.dit, recipe.vae.z_dim, recipe.text.d_model)
    transformer.load_state_dict(state["parts"]["ema"]["module"])
    text = build_text(recipe.text)
    # the run encoded its captions before saving, which leaves the fast tokenizer's padding and truncation set (and
    # saved in tokenizer.json); encoding one prompt the same way makes the saved files the run's, byte for byte
    caption_embeddings(assemble(transformer, vae, text, recipe.sampling.shift), [""])
    path = save_model(transformer.eval(), vae, text, recipe, args.dest)
    print(json.dumps({"step": int(state["step"]), "of_steps": int(state["steps"]), "checkpoint": path,
                      "transformer_params": sum(p.numel() for p in transformer.parameters())}))


if __name__ == "__main__":
    main()
