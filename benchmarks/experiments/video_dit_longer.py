"""Experiment: does a longer transformer phase (at another rate, on other clips or text) lift the shapes-video model's
multi-object categories?

The shipped shapes-video model's transformer stopped at 6,000 steps with its loss still falling, and passes two_motions
and order on under 6 % of its clips (docs/moving_shapes.md, "What the model draws"). The recipe's resume state is not
shipped, so this continues **from the shipped weights**: the shipped (EMA) transformer as both the trained weights and
the EMA's start (its update count set to the recipe's steps, so the average runs at the recipe's decay at once), a
fresh AdamW warmed up over the recipe's warm-up steps, the recipe's batches drawn on from step 6,000 (step s draws what
an uninterrupted longer run would draw at s), the same latents (the recipe's clips, encoded by the shipped VAE and
normalised with its shipped statistics) and captions. Every `--save-every` steps the EMA transformer is saved as a
full checkpoint (the shipped VAE, text encoder and defaults beside it) under `OUT/step_<n>`, ready for
`omniroll eval --model OUT/step_<n>`. The continuation may also change what the recipe fixed: its learning rate and
schedule (`--lr`, `--cosine-decay`), the clips' mix of categories (`--category-weights`), and whether the text
encoder trains too (`--train-text-encoder`; its averaged weights are then saved in the checkpoint), or is swapped for
a random BERT of its shape, whose absolute positions tell word order apart (`--bert-text`; saved in the checkpoint),
and whether some direction and order clips are captioned without their colours (`--colourless P`: each such clip's
caption loses its colour words with probability P, drawn once per clip from the latents' seed; "a red circle moving
left" -> "a circle moving left"): two-motion prompts name no colour, and the model must then hold a colour it chose
itself through the clip, which no other category's captions ask of it. Or the other way round: every two-motion clip
captioned with the colours its objects were drawn in (`--coloured-two-motions`: "a red square moving up and a blue
triangle moving down", a form the grammar does not have; `video_coloured_two_motions.py` asks it of a model). Or
every two-motion clip drawn with its first-named object left of the other (`--first-object-left`: the recipe's
`two_motions_layout="first_left"`, `omniroll.tasks.moving_shapes.scene`: the middle of the first object's path at
least 8 px left of the second's; the checker asks nothing of where objects are, so these clips satisfy their prompts
as the recipe's do): a convention that ties each shape word to a side of the clip, to see whether what fails is
telling the two objects apart.

Not bitwise what `make shapes-video-model` with a longer `dit.steps` gives (Adam's moments restart): an experiment
to decide whether the recipe should train longer, not a way to make the shipped model.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/experiments/video_dit_longer.py --steps 1600 \\
        --save-every 800 --out out/video-dit-longer      # the run docs/moving_shapes.md reports (there: --threads 1)
    ... --steps 2000 --save-every 1000 --lr 1e-3 --cosine-decay \\
        --category-weights direction=0.5,two_motions=2,order=2,change=1 \\
        [--train-text-encoder | --bert-text]   # the three runs after it (--bert-text: --steps 1500)
    ... --steps 2000 --save-every 1000 --lr 1e-3 --cosine-decay \\
        --category-weights direction=1,two_motions=3,order=1,change=1 \\
        [--colourless 0.5 | --coloured-two-motions | --first-object-left]   # the runs on the model that ships

Ends with one JSON line (steps run, seconds a step, the mean loss of the first and last 100 steps, the checkpoints).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time

import numpy as np
import torch

from omniroll.models.shapes.dit import EMA, optimizer_step
from omniroll.models.shapes.vae import lr_at
from omniroll.models.shapes_video import checkpoint_dir
from omniroll.models.shapes_video.dit import flow_loss
from omniroll.models.shapes_video.pretrain import caption_embeddings, encode_latents, save_model
from omniroll.models.shapes_video.progress import progress_bar
from omniroll.models.shapes_video.recipe import ShapesVideoRecipe
from omniroll.models.shapes_video.resume import step_generator
from omniroll.models.shapes_video.text import TEXT_LENGTH
from omniroll.models.shapes_video.vae import normalise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1600, help="transformer steps on top of the shipped ones")
    ap.add_argument("--save-every", type=int, default=800, help="steps between saved checkpoints")
    ap.add_argument("--num-latents", type=int, default=None, help="training clips (default: the recipe's; fewer for "
                                                                      "a smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the recipe's)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate of the continuation (default: the "
                                                            "recipe's)")
    ap.add_argument("--cosine-decay", action="store_true", help="decay the rate over the continuation's steps to a "
                                                                "tenth (cosine), instead of the recipe's constant")
    ap.add_argument("--category-weights", default=None, help="clips drawn per category for the continuation, e.g. "
                                                             "direction=0.5,two_motions=2,order=2,change=1 (default: "
                                                             "the recipe's; other weights draw and encode other clips)")
    ap.add_argument("--train-text-encoder", action="store_true", help="train the text encoder (frozen in the "
                                                                      "recipe) with the transformer (one optimizer, "
                                                                      "one EMA)")
    ap.add_argument("--bert-text", action="store_true", help="swap the text encoder for a random BERT of its shape "
                                                             "(absolute positions; video_text_twins.py's), frozen "
                                                             "unless --train-text-encoder")
    ap.add_argument("--colourless", type=float, default=0.0, help="the share of direction and order clips captioned "
                    "without their colour words (default 0: none)")
    ap.add_argument("--coloured-two-motions", action="store_true", help="caption every two-motion clip with the "
                    "colours its objects were drawn in (\"a red square moving up and a blue triangle moving down\")")
    ap.add_argument("--first-object-left", action="store_true", help="draw every two-motion clip with its "
                    "first-named object left of the other (module doc)")
    ap.add_argument("--out", default="out/video-dit-longer")
    args = ap.parse_args()
    if not 0.0 <= args.colourless <= 1.0:
        raise SystemExit(f"--colourless must be in [0, 1], got {args.colourless}")
    if sum(map(bool, (args.colourless, args.coloured_two_motions, args.first_object_left))) > 1:
        raise SystemExit("--colourless, --coloured-two-motions and --first-object-left are separate experiments: "
                         "give one")
    if args.steps < 1 or args.save_every < 1 or (args.num_latents is not None and args.num_latents < 1):
        raise SystemExit("--steps, --save-every and --num-latents must be >= 1")
    if args.lr is not None and not args.lr > 0:
        raise SystemExit(f"--lr must be > 0, got {args.lr}")
    from diffusers import WanPipeline

    src = checkpoint_dir()  # the shipped checkpoint, verified against its SHA256SUMS
    with open(os.path.join(src, "recipe.json")) as f:
        recipe = ShapesVideoRecipe.from_dict(json.load(f))
    weights = category_weights(args.category_weights, recipe.category_weights)
    torch.set_num_threads(args.threads or recipe.torch_threads)
    os.makedirs(args.out, exist_ok=True)
    pipe = WanPipeline.from_pretrained(src, torch_dtype=torch.float32)
    vae, transformer = pipe.vae.eval(), pipe.transformer
    if args.bert_text:
        from video_text_twins import random_bert  # this script's neighbour

        conf = pipe.text_encoder.config
        pipe.text_encoder = random_bert(len(pipe.tokenizer), conf.num_layers, conf.d_model)
    text = {"text_encoder": pipe.text_encoder, "tokenizer": pipe.tokenizer}

    # 1. the recipe's latents, normalised with the shipped statistics; the captions' embeddings
    n = args.num_latents or recipe.dit.num_latents
    tag = "" if weights == recipe.category_weights else "_" + "_".join(f"{k}{v:g}" for k, v in weights.items())
    cache = os.path.join(args.out, f"latents_{n}{tag}")  # encode_latents keeps them in <dir>/latents.pt
    first_n = dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, num_latents=n), category_weights=weights)
    if args.first_object_left:
        first_n, cache = dataclasses.replace(first_n, two_motions_layout="first_left"), cache + "_first_left"
    os.makedirs(cache, exist_ok=True)
    with torch.no_grad():
        caps, means = encode_latents(vae, first_n, cache, True)
    latents = normalise(vae, means)
    caps = colourless_captions(caps, args.colourless, recipe.latent_data_seed)
    if args.coloured_two_motions:
        caps = coloured_two_motion_captions(caps, first_n)
    embeds, caption_ids, empty = caption_embeddings(pipe, caps)

    # 2. continue the transformer (and the text encoder): fresh AdamW (warm-up again), the EMA at full decay from the
    # shipped weights
    r = dataclasses.replace(recipe.dit, steps=recipe.dit.steps + args.steps)
    # the continuation's schedule: warm-up from its own step 0, then constant or decayed over its own steps
    schedule = dataclasses.replace(r, steps=args.steps, lr=args.lr or r.lr, cosine_decay=args.cosine_decay)
    model = Trained(transformer, text, caps)
    with torch.no_grad():  # the differentiable encoding is the pipeline's (batched, so up to its last bits)
        gap = float((model.embeds() - embeds).abs().max())
    assert gap < 1e-5, f"the encoding differs from the pipeline's by {gap}"
    model.train().requires_grad_(True)
    model.text_encoder.requires_grad_(args.train_text_encoder)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=r.lr, weight_decay=r.weight_decay)
    ema = EMA(model, r.ema_decay)
    ema.updates = recipe.dit.steps
    history, saved, bar = [], [], progress_bar(args.steps, "transformer+", True)
    for s in range(args.steps):
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(s, schedule)  # the warm-up of a fresh optimizer
        step = recipe.dit.steps + s  # the batch and noise an uninterrupted run draws at this step
        step_embeds = model.embeds() if args.train_text_encoder else embeds
        loss = flow_loss(transformer, r, latents, caption_ids, step_embeds, empty, step_generator(r.seed, step))
        history.append(optimizer_step(model, opt, ema, loss, step, t0))
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['loss']:.4f}")
        if (s + 1) % args.save_every == 0 or s + 1 == args.steps:
            path = os.path.join(args.out, f"step_{step + 1}")
            shutil.rmtree(path, ignore_errors=True)
            out_recipe = dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, steps=step + 1))
            averaged = ema.module
            save_model(averaged.transformer, vae, {"tokenizer": text["tokenizer"],
                                                   "text_encoder": averaged.text_encoder}, out_recipe, path)
            saved.append(path)
    bar.close()
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history, f)
    losses = [h["loss"] for h in history]
    print(json.dumps({"steps": args.steps, "from_step": recipe.dit.steps, "lr": schedule.lr,
                      "train_text_encoder": args.train_text_encoder, "bert_text": args.bert_text,
                      "cosine_decay": schedule.cosine_decay, "category_weights": weights,
                      "colourless": args.colourless, "coloured_two_motions": args.coloured_two_motions,
                      "first_object_left": args.first_object_left,
                      "seconds_per_step": float(np.median([h["seconds"] for h in history])),
                      "loss_first_100": float(np.mean(losses[:100])), "loss_last_100": float(np.mean(losses[-100:])),
                      "checkpoints": saved}))


class Trained(torch.nn.Module):
    """The transformer and the text encoder as one module (one optimizer, one EMA; the encoder trains only when its
    parameters require gradients); `embeds()` encodes the captions as the Wan pipeline does (padding zeroed), in
    `caption_embeddings`' order, with gradients."""

    def __init__(self, transformer, text: dict, prompts: list[str]):
        super().__init__()
        self.transformer = transformer
        sorted_prompts = sorted(set(prompts) - {""}) + [""]  # caption_embeddings' order
        tok = text["tokenizer"](sorted_prompts, padding="max_length", max_length=TEXT_LENGTH, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        self.ids, self.mask = tok.input_ids, tok.attention_mask
        self.text_encoder = text["text_encoder"]

    def embeds(self) -> torch.Tensor:
        h = self.text_encoder(self.ids, self.mask).last_hidden_state
        return h * self.mask[..., None].to(h.dtype)


def colourless_captions(caps: list[str], share: float, seed: int) -> list[str]:
    """`caps` with each direction or order caption's colour words dropped with probability `share` (one draw per
    clip from `seed`; change captions, whose colours are what they ask, and two-motion ones, which have none, kept)."""
    from omniroll.tasks.moving_shapes.grammar import parse_prompt
    from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD

    colours = set(DEFAULT_MOVING_WORLD.colours)
    draws = np.random.default_rng(seed).random(len(caps))
    return [" ".join(w for w in c.split(" ") if w not in colours)
            if d < share and parse_prompt(c).tag in ("direction", "order") else c for c, d in zip(caps, draws)]


def coloured_two_motion_captions(caps: list[str], recipe: ShapesVideoRecipe) -> list[str]:
    """`caps` (the captions of `recipe`'s latents, in order) with each two-motion caption naming the colours its
    clip's objects were drawn in: the clip's render seed drawn again (`TrainingClips.draws`, chunk by chunk as
    `encode_latents` drew them) and the scene `render_prompt` drew from it (`prompt_scene`)."""
    from dataclasses import replace

    from omniroll.models.shapes_video.data import TrainingClips
    from omniroll.models.shapes_video.pretrain import LATENT_CHUNK
    from omniroll.tasks.moving_shapes.grammar import parse_prompt, prompt_text
    from omniroll.tasks.moving_shapes.render import prompt_scene

    data, n, drawn, seeds = TrainingClips(recipe.category_weights), len(caps), [], []
    for i, start in enumerate(range(0, n, LATENT_CHUNK)):
        c, s = data.draws(recipe.latent_data_seed, i, min(LATENT_CHUNK, n - start))
        drawn.extend(c)
        seeds.extend(s)
    assert drawn == caps, "the captions drawn again differ from the latents' captions"
    out = []
    for c, seed in zip(caps, seeds):
        spec = parse_prompt(c)
        if spec.tag == "two_motions":
            objects = prompt_scene(c, seed).objects  # in the order of the prompt's actors
            c = prompt_text(spec.tag, tuple(replace(a, colour=o.colour) for a, o in zip(spec.actors, objects)))
        out.append(c)
    return out


def category_weights(text: str | None, default: dict) -> dict:
    """The recipe's category weights with `name=value,...` from the command line over them (names checked)."""
    out = dict(default)
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in default:
            raise SystemExit(f"--category-weights: unknown category {name!r}; known: {sorted(default)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"--category-weights: {name} needs a number >= 0, got {value!r}") from None
        if out[name] < 0:
            raise SystemExit(f"--category-weights: {name} needs a number >= 0, got {value!r}")
    return out


if __name__ == "__main__":
    main()
