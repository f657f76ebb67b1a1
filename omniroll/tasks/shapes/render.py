"""The renderer: a scene to a 64 x 64 RGB picture (uint8, [H, W, 3]), filled shapes on a plain background,
antialiased by supersampling (`outlines.coverage`), and a seeded `render_prompt` for a prompt."""

from __future__ import annotations

import numpy as np

from omniroll.tasks.shapes.grammar import parse_prompt
from omniroll.tasks.shapes.outlines import coverage
from omniroll.tasks.shapes.scene import Scene, sample_scene
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World


def render(scene: Scene, world: World = DEFAULT_WORLD, supersample: int = 4) -> np.ndarray:
    """uint8 [size, size, 3]: the background, then each object blended in by the share of each pixel it covers."""
    n = world.size
    img = np.empty((n, n, 3), dtype=np.float32)
    img[:] = np.asarray(world.background, dtype=np.float32)
    for o in scene.objects:
        x0, y0, x1, y1 = o.box
        # only the object's box (plus a pixel) is sampled
        i0, i1 = max(int(np.floor(y0)) - 1, 0), min(int(np.ceil(y1)) + 1, n)
        j0, j1 = max(int(np.floor(x0)) - 1, 0), min(int(np.ceil(x1)) + 1, n)
        a = coverage(o.shape, o.cx - j0, o.cy - i0, o.size, o.size, i1 - i0, j1 - j0, supersample)[..., None]
        colour = np.asarray(world.colours[o.colour], dtype=np.float32)
        img[i0:i1, j0:j1] = img[i0:i1, j0:j1] * (1 - a) + colour * a
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def render_prompt(prompt: str, seed: int, world: World = DEFAULT_WORLD) -> np.ndarray:
    """A picture satisfying a grammar prompt, the same for the same prompt, seed and world (uint8 [H, W, 3])."""
    return render(sample_scene(parse_prompt(prompt, world), np.random.default_rng(seed), world), world)
