"""The moving-shapes docs page's animated example: clips of a shapes-video model, one per category, side by side,
each under its prompt and the checker's verdict, as one animated lossless WebP.

The clips are `omniroll generate`'s own (its `prompt_NNN_s0_frames.png`, the frames left to right, are cut back into
frames), at the model's defaults and the given guidance and seed, so the picture is what a user running the command
gets.

    python benchmarks/moving_shapes_animation.py                   # docs/moving_shapes_example.webp (CFG 4.5, seed 0)
    python benchmarks/moving_shapes_animation.py --model out/shapes-video-model/checkpoint --guidance 1 --out x.webp
"""

from __future__ import annotations

import argparse
import os
import tempfile
import textwrap

import numpy as np
from PIL import Image, ImageDraw

from omniroll.cli import main as omniroll_main
from omniroll.tasks.moving_shapes.grammar import parse_prompt
from omniroll.tasks.moving_shapes.judge import score_clip
from omniroll.tasks.shapes.report import caption_font

HERE = os.path.dirname(os.path.abspath(__file__))
#: one prompt per category, the held-out direction prompt first
PROMPTS = ("a red circle moving down", "a circle moving left and a square moving right",
           "a red circle appears, then a yellow square", "a circle turning from red to yellow")


def draw_clips(model: str, guidance: float, seed: int, frames_of_clip: int = 9) -> list[np.ndarray]:
    """Each prompt's clip from `omniroll generate` (uint8 [T, H, W, 3])."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("\n".join(PROMPTS) + "\n")
        out = os.path.join(tmp, "gen")
        argv = ["generate", "--model", model, "--prompts-file", prompts, "--guidance", str(guidance), "--seed",
                str(seed), "--out", out, "--quiet"]
        if omniroll_main(argv) != 0:
            raise SystemExit(f"omniroll {' '.join(argv)} failed")
        clips = []
        for i in range(len(PROMPTS)):
            strip = np.asarray(Image.open(os.path.join(out, f"prompt_{i:03d}_s0_frames.png")).convert("RGB"))
            clips.append(np.stack(np.split(strip, frames_of_clip, axis=1)))
    return clips


def compose(clips: list[np.ndarray], scale: int = 3) -> list[Image.Image]:
    """One frame per clip frame: the clips side by side, upscaled `scale` x (nearest), each under its caption."""
    font = caption_font(12)
    T, H, W, _ = clips[0].shape
    cell_w, cap, pad = max(W * scale, 250), 34, 6
    verdicts = [score_clip(parse_prompt(p), c) for p, c in zip(PROMPTS, clips)]
    frames = []
    for t in range(T):
        canvas = Image.new("RGB", (len(clips) * (cell_w + pad) + pad, cap + H * scale + 2 * pad), "white")
        draw = ImageDraw.Draw(canvas)
        for k, (prompt, clip, v) in enumerate(zip(PROMPTS, clips, verdicts)):
            x = pad + k * (cell_w + pad)
            ok = v.strict
            lines = textwrap.wrap(("pass: " if ok else "fail: ") + prompt, 36)
            for row, line in enumerate(lines[:2]):
                draw.text((x, pad + 15 * row), line, fill=(0, 120, 0) if ok else (170, 0, 0), font=font)
            big = Image.fromarray(clip[t]).resize((W * scale, H * scale), Image.NEAREST)
            canvas.paste(big, (x + (cell_w - W * scale) // 2, cap + pad))
        frames.append(canvas)
    return frames


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes-video")
    p.add_argument("--guidance", type=float, default=4.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=int, default=4, help="frames per second of the animation (9 frames a clip)")
    p.add_argument("--out", default=os.path.join(HERE, "..", "docs", "moving_shapes_example.webp"))
    args = p.parse_args()
    frames = compose(draw_clips(args.model, args.guidance, args.seed))
    frames[0].save(args.out, save_all=True, append_images=frames[1:], duration=round(1000 / args.fps), loop=0,
                   lossless=True)
    print(f"wrote {os.path.abspath(args.out)} ({len(frames)} frames, {frames[0].size[0]} x {frames[0].size[1]} px)")


if __name__ == "__main__":
    main()
