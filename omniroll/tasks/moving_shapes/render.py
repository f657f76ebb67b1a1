"""The renderer: a clip scene to uint8 frames [T, 3, H, W] (the layout of a video `RewardSample`), each frame drawn
by the shapes world's renderer (`omniroll.tasks.shapes.render`), and a seeded `render_prompt` for a prompt (its scene:
`prompt_scene`)."""

from __future__ import annotations

import numpy as np

from omniroll.tasks.moving_shapes.grammar import parse_prompt
from omniroll.tasks.moving_shapes.scene import ClipScene, sample_clip_scene
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld
from omniroll.tasks.shapes.render import render


def render_clip(scene: ClipScene, world: MovingWorld = DEFAULT_MOVING_WORLD) -> np.ndarray:
    """uint8 [T, 3, size, size]: each frame's picture, channels first."""
    frames = [render(scene.frame(t), world.picture) for t in range(scene.frames)]
    return np.ascontiguousarray(np.stack(frames).transpose(0, 3, 1, 2))


def prompt_scene(prompt: str, seed: int, world: MovingWorld = DEFAULT_MOVING_WORLD, layout: str = "any") -> ClipScene:
    """The scene `render_prompt(prompt, seed, world, layout)` draws (its objects' colours, paths and timings; `layout`:
    where a two-motion scene puts its objects, `scene.TWO_MOTIONS_LAYOUTS`)."""
    return sample_clip_scene(parse_prompt(prompt, world), np.random.default_rng(seed), world, layout=layout)


def render_prompt(prompt: str, seed: int, world: MovingWorld = DEFAULT_MOVING_WORLD, layout: str = "any") -> np.ndarray:
    """A clip satisfying a grammar prompt, the same for the same prompt, seed, world and layout (uint8 [T, 3, H, W])."""
    return render_clip(prompt_scene(prompt, seed, world, layout), world)
