"""Experiment: does a two-motion prompt that names its objects' colours pass where the colourless one fails?

The shipped shapes-video model passes two_motions on 2.5 % of its held-out clips, and four in five of its two-motion
tracks change colour during the clip, where a named colour holds on 91-94 % of direction tracks
(docs/moving_shapes.md, "The colour no prompt names drifts"). The grammar's two-motion prompts name no colour. This
asks prompts that do ("a red square moving up and a blue triangle moving down") of one or more models, and judges
each clip twice with the world's checker: against the coloured requirement (each object's shape, its named colour,
its motion) and against the grammar's colourless one (shape and motion only). The grammar does not parse coloured
two-motion prompts, so the requirement is built from the colourless prompt's actors with the colours added; the
checker's rules already check a named colour for a moving object (as for direction prompts).

Prompts: each two-motion prompt of the split (held out: the requirement combinations no training clip shows) with
`--colours` pairs of two different colours (drawn once, from a fixed seed, the same for every model), one clip each
at the evaluation's seed of the coloured prompt, the model's own sampling (CFG 4.5, 10 steps). Every model draws the
same clips' seeds, so the later models are paired with the first (McNemar's z on the coloured strict verdict).

    .venv/bin/python benchmarks/experiments/video_coloured_two_motions.py shapes-video out/coloured/step_8000 \\
        [--split heldout] [--colours 4] [--strips out/coloured_strips.png]

`video_dit_longer.py --coloured-two-motions` continues the shipped transformer on captions that name the colours.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np


def coloured_specs(split: str, pairs: int, seed: int = 0) -> list:
    """The split's two-motion prompts, each with `pairs` pairs of different colours: [(coloured spec, colourless
    spec)], in the grammar's order."""
    from omniroll.tasks.moving_shapes.grammar import ClipSpec, parse_prompt, prompt_text
    from omniroll.tasks.moving_shapes.splits import split_prompts
    from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD

    colours, rng, out = DEFAULT_MOVING_WORLD.colours, np.random.default_rng(seed), []
    for p in split_prompts(split):
        spec = parse_prompt(p)
        if spec.tag != "two_motions":
            continue
        for _ in range(pairs):
            c1, c2 = (colours[int(i)] for i in rng.choice(len(colours), size=2, replace=False))
            actors = (replace(spec.actors[0], colour=c1), replace(spec.actors[1], colour=c2))
            out.append((ClipSpec(prompt_text(spec.tag, actors), spec.tag, actors), spec))
    return out


def drawn_clips(model: str, prompts: list[str]) -> tuple[list[np.ndarray], list[int]]:
    """(uint8 clips [T, H, W, 3], seeds): one clip of each prompt by `model` at the evaluation's sampling (10 steps,
    the shapes-video model's own) and seeds (the first evaluation seed of each prompt)."""
    from omniroll import GenerationRequest, SamplingParams
    from omniroll.config import load_config
    from omniroll.evaluation.shapes import eval_seed, sample_array
    from omniroll.evaluation.shapes_proxy import open_engine

    engine, sampling = open_engine(model, steps=10)
    try:
        sp = SamplingParams(**{**sampling, "logprobs": False})
        seeds = [eval_seed(load_config({}).val_kwargs.seed, p, 0) for p in prompts]
        outs = engine.generate([GenerationRequest(request_id=f"c-{i}", prompt=p, seed=s, sampling_params=sp)
                                for i, (p, s) in enumerate(zip(prompts, seeds))], progress=True)
    finally:
        engine.shutdown()
    return [sample_array(o.diffusion_output) for o in outs], seeds


def strips_picture(path: str, prompts: list[str], drawn: dict, verdicts: dict, rows: int = 8) -> None:
    """The first `rows` prompts' clips as film strips, one line per model under each prompt, with its verdicts
    (coloured strict / colourless strict), 2x upscaled."""
    from PIL import Image, ImageDraw

    from omniroll.tasks.moving_shapes.report import film_strip

    lines = []
    for i, p in enumerate(prompts[:rows]):
        lines.append((p, None))
        lines += [(f"{m}: coloured {'pass' if verdicts[m][0][i] else 'fail'}, shapes and motion "
                   f"{'pass' if verdicts[m][1][i] else 'fail'}", film_strip(drawn[m][i])) for m in drawn]
    width = max(s.shape[1] for _, s in lines if s is not None) * 2
    height = sum(14 + (0 if s is None else s.shape[0] * 2 + 4) for _, s in lines)
    out = Image.new("RGB", (width, height), "white")
    draw, y = ImageDraw.Draw(out), 0
    for text, strip in lines:
        draw.text((2, y), text, fill="black")
        y += 14
        if strip is not None:
            out.paste(Image.fromarray(strip).resize((strip.shape[1] * 2, strip.shape[0] * 2), Image.NEAREST), (0, y))
            y += strip.shape[0] * 2 + 4
    out.save(path)


def main() -> None:
    from omniroll.evaluation.paired import paired
    from omniroll.tasks.moving_shapes.judge import detect_frames, judge_clip

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="shapes-video models (a name or a checkpoint directory); the later "
                                              "ones are paired with the first")
    ap.add_argument("--split", default="heldout", choices=("train", "heldout"))
    ap.add_argument("--colours", type=int, default=4, help="colour pairs per two-motion prompt (>= 1)")
    ap.add_argument("--strips", default=None, help="write the first 8 prompts' clips as film strips to this PNG")
    args = ap.parse_args()
    if args.colours < 1:
        raise SystemExit(f"--colours must be >= 1, got {args.colours}")
    specs = coloured_specs(args.split, args.colours)
    prompts = [c.prompt for c, _ in specs]
    print(f"# {len(prompts)} coloured two-motion prompts of the {args.split} split, one clip each; e.g. {prompts[0]!r}")
    print("| model | clips | strict, coloured | shapes and motion (colourless) | colours met | paired with the first "
          "(up / down, z) |")
    print("|---|---:|---:|---:|---:|---|")
    result, first, drawn, verdicts = {"split": args.split, "clips": len(prompts), "models": {}}, None, {}, {}
    for model in args.models:
        t0 = time.time()
        clips, seeds = drawn_clips(model, prompts)
        drawn[model] = clips[:8]
        coloured, colourless, colour_met = [], [], []
        for (spec, plain), clip in zip(specs, clips):
            frames = detect_frames(clip)
            j = judge_clip(spec, frames)
            coloured.append(bool(j.strict))
            colourless.append(bool(judge_clip(plain, frames).strict))
            named = {f"{a.shape} {a.colour}" for a in spec.actors}  # the rules' name of a colour requirement
            colour_met.append(np.mean([ok for name, ok in j.met if name in named]))
        verdicts[model] = (coloured, colourless)
        row = {"strict": float(np.mean(coloured)), "colourless": float(np.mean(colourless)),
               "colours": float(np.mean(colour_met)), "seconds": round(time.time() - t0, 1)}
        pictures = [{"prompt": p, "seed": s, "tag": "two_motions", "strict": v}
                    for p, s, v in zip(prompts, seeds, coloured)]
        versus = ""
        if first is None:
            first = pictures
        else:
            cmp = paired(first, pictures)["overall"]  # the same (prompt, seed) pairs, or ValueError
            row.update(up=cmp["up"], down=cmp["down"], z=round(cmp["z"], 2))
            versus = f"{cmp['up']} / {cmp['down']}, z {row['z']:+.2f}"
        result["models"][model] = row
        print(f"| {model} | {len(prompts)} | {100 * row['strict']:.1f} | {100 * row['colourless']:.1f} | "
              f"{100 * row['colours']:.1f} | {versus} |", flush=True)
    if args.strips:
        strips_picture(args.strips, prompts, drawn, verdicts)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
