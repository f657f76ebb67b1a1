"""Renders of a task world by name: `render_task_prompt(task, prompt, seed)` (one sample satisfying a prompt, laid
out as a model's decoded samples) and the size its renders have (`task_render_size`, `check_render_size`)."""

from __future__ import annotations

import numpy as np

#: the task worlds with a renderer
RENDERING_TASKS = ("shapes", "moving_shapes")


def render_task_prompt(task: str, prompt: str, seed: int) -> np.ndarray:
    """uint8 pixels of one render of `prompt` in world `task`, laid out as the adapter's `decode` returns samples:
    a picture [3, H, W] or a clip [T, 3, H, W]."""
    if task == "shapes":
        from omniroll.tasks.shapes.render import render_prompt

        return np.ascontiguousarray(render_prompt(prompt, seed).transpose(2, 0, 1))
    if task == "moving_shapes":
        from omniroll.tasks.moving_shapes.render import render_prompt

        return render_prompt(prompt, seed)
    raise ValueError(f"the {task!r} world has no renderer (worlds with one: {list(RENDERING_TASKS)})")


def task_render_size(task: str) -> tuple[int, int]:
    """(picture side in pixels, frames) of world `task`'s renders."""
    if task == "moving_shapes":
        from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD

        return DEFAULT_MOVING_WORLD.picture.size, DEFAULT_MOVING_WORLD.frames
    from omniroll.tasks.shapes.world import DEFAULT_WORLD

    return DEFAULT_WORLD.size, 1


def check_render_size(task: str, height: int, width: int, num_frames: int, prompts: list[str], field: str) -> None:
    """ValueError naming `field` when world `task` has no renderer, renders another size than the one given, or
    cannot render one of `prompts` (the first such is named)."""
    if task not in RENDERING_TASKS:
        raise ValueError(f"{field}: the {task!r} world has no renderer (worlds with one: {list(RENDERING_TASKS)})")
    side, frames = task_render_size(task)
    if (height, width, num_frames) != (side, side, frames):
        raise ValueError(f"{field}: the {task} world renders {side} x {side} px, {frames} frame(s); "
                         f"pipeline.height / width / num_frames must be those, got {height} / {width} / {num_frames}")
    if task == "shapes":
        from omniroll.tasks.shapes.grammar import parse_prompt
    else:
        from omniroll.tasks.moving_shapes.grammar import parse_prompt
    for prompt in prompts:
        try:
            parse_prompt(prompt)
        except ValueError as e:
            raise ValueError(f"{field}: the {task} world cannot render the training prompt {prompt!r}: {e}") from None
