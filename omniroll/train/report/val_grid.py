"""The validation grid picture (`val_before.png`, `val_after.png`, ...): one row per prompt, every picture captioned
under it with its prompt (wrapped to the picture's width), its reward and, when the reward has several components,
each component's own value. A video is shown as its film strip (its frames left to right, at their own size).

The captions are drawn in DejaVu Sans, the TrueType font matplotlib ships (PIL's built-in bitmap font where it is
missing), dark on white, at a size that grows with the picture (11-28 px). A cell is at least `MIN_CELL` px wide, so
a caption under a 64 px picture stays readable.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from omniroll.tasks.shapes.report import caption_font, wrap

MIN_CELL = 176  # px: the narrowest cell (a picture narrower than this is centred in it)
PAD = 6  # px around each caption


def caption_lines(prompt: str, reward: Optional[float], components: Optional[dict[str, float]] = None) -> list[str]:
    """The unwrapped caption of one picture: its prompt, `reward +0.1234`, and one `name +0.1234` per component when
    there are several."""
    out = [prompt]
    if reward is not None:
        out.append(f"reward {reward:+.4f}")
    if components and len(components) > 1:
        out += [f"{name} {value:+.4f}" for name, value in components.items()]
    return out


def save_val_grid(images: torch.Tensor, rows: int, cols: int, path: str, scale: int = 2,
                  captions: Optional[Sequence[Sequence[str]]] = None) -> None:
    """uint8 [rows * cols, 3, H, W] -> one PNG, a row per prompt (nearest-neighbour upscaled by `scale`), each picture
    over its caption (`captions[i]`: its lines, from `caption_lines`; the first one, the prompt, is wrapped). Videos
    (uint8 [rows * cols, T, 3, H, W]) are drawn as film strips, not upscaled."""
    from PIL import Image, ImageDraw

    n = images.shape[0]
    if n != rows * cols:
        raise ValueError(f"save_val_grid: {n} images for {rows} rows x {cols} columns")
    if images.ndim == 5:
        from omniroll.tasks.moving_shapes.report import film_strip

        pics, scale = [Image.fromarray(film_strip(images[i].numpy())) for i in range(n)], 1
    else:
        pics = [Image.fromarray(images[i].permute(1, 2, 0).contiguous().numpy()) for i in range(n)]
    W, H = pics[0].size
    if scale > 1:
        pics = [p.resize((W * scale, H * scale), Image.NEAREST) for p in pics]
    pw, ph = pics[0].size
    cell_w = max(pw, MIN_CELL) if captions is not None else pw
    font = caption_font(max(11, min(28, min(cell_w, 4 * ph) // 14)))  # a film strip's: as its frames'
    line_h = int(font.getbbox("Ag")[3] * 1.3) + 1 if captions is not None else 0
    wrapped = [[ln for j, text in enumerate(c) for ln in (wrap(text, font, cell_w - 2 * PAD) if j == 0 else [text])]
               for c in captions] if captions is not None else [[] for _ in range(n)]
    cap_h = max(len(w) for w in wrapped) * line_h + 2 * PAD if captions is not None else 0
    grid = Image.new("RGB", (cols * cell_w, rows * (ph + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, pic in enumerate(pics):
        x, y = (i % cols) * cell_w, (i // cols) * (ph + cap_h)
        grid.paste(pic, (x + (cell_w - pw) // 2, y))
        for j, line in enumerate(wrapped[i]):
            draw.text((x + PAD, y + ph + PAD + j * line_h), line, fill=(20, 20, 20), font=font)
    grid.save(path)
