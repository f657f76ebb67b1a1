"""The moving-shapes world's film strips for its docs page: rendered clips of each category, frames left to right,
each under its prompt and the checker's verdict, and two cheats (a clip reversed in time, a clip frozen to its first
frame) with the reason the checker gives.

    python benchmarks/moving_shapes_strips.py                   # writes docs/moving_shapes_strips.png
    python benchmarks/moving_shapes_strips.py --out strips.png --seed 3
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from PIL import Image, ImageDraw

from omniroll.tasks.moving_shapes.cheats import apply_order, cheat_order
from omniroll.tasks.moving_shapes.grammar import parse_prompt
from omniroll.tasks.moving_shapes.judge import score_clip
from omniroll.tasks.moving_shapes.render import render_prompt
from omniroll.tasks.shapes.report import caption_font

HERE = os.path.dirname(os.path.abspath(__file__))
#: (prompt, cheat or None): one rendered clip per category, then two cheats
ROWS = [("a red circle moving left", None), ("a square moving up and a triangle moving down", None),
        ("a red circle appears, then a blue square", None), ("a triangle turning from blue to green", None),
        ("a red circle moving left", "reversed"), ("a triangle turning from blue to green", "frozen")]


def strips(seed: int, scale: int = 2) -> Image.Image:
    """One row per `ROWS` entry: the caption (verdict, prompt, cheat, reason) above the clip's frames."""
    clips = []
    for prompt, cheat in ROWS:
        clip = render_prompt(prompt, seed)
        if cheat is not None:
            clip = apply_order(clip, cheat_order(cheat, len(clip)))
        clips.append((prompt, cheat, clip, score_clip(parse_prompt(prompt), clip)))
    T, _, H, W = clips[0][2].shape
    pad, cap = 4, 18
    font = caption_font(12)
    canvas = Image.new("RGB", (T * (W * scale + pad) + pad, len(clips) * (H * scale + cap + pad) + pad),
                       (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r, (prompt, cheat, clip, j) in enumerate(clips):
        y = pad + r * (H * scale + cap + pad)
        mark, colour = ("\u2713", (0, 120, 0)) if j.strict else ("\u2717", (190, 0, 0))
        text = f"{mark} {prompt!r}" + (f"  [{cheat}]: {j.reasons[0]}" if cheat else f"  (motion {j.motion:.0f} px)")
        draw.text((pad, y + 2), text, fill=colour, font=font)
        for t in range(T):
            frame = Image.fromarray(np.ascontiguousarray(clip[t].transpose(1, 2, 0)))
            canvas.paste(frame.resize((W * scale, H * scale), Image.NEAREST), (pad + t * (W * scale + pad), y + cap))
    return canvas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "moving_shapes_strips.png"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    strips(args.seed).save(args.out, optimize=True)
    print(os.path.normpath(args.out))


if __name__ == "__main__":
    main()
