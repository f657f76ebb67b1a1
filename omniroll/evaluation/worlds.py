"""The task worlds an evaluation judges a model in: the shapes world's pictures or the moving-shapes world's clips,
chosen by the model's checkpoint (`omniroll.models.checkpoint.read_task`), each with its prompts, its checker and
how a sample is drawn in a grid.

    world = world_of(model_dir)                # WORLDS["moving_shapes"] for a shapes-video checkpoint
    world.prompts_of("heldout")                # the world's split (or a file of its prompts)
    world.score(prompts, samples, seeds)       # `Scored` rows (`omniroll.tasks.shapes.report.Report` tabulates them)
    world.cell(sample)                         # what a grid shows: the picture, or the clip's film strip
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniroll.tasks.shapes.report import Scored


@dataclass(frozen=True)
class EvalWorld:
    """task: the name a checkpoint states (`omniroll.models.checkpoint.TASKS`). clips: its samples are clips
    [T, H, W, 3] (else pictures [H, W, 3]). grid_per_category: samples per category in an evaluation's grid (one
    row per category); flip_columns: samples per row of the flips picture; scale: the grids' enlargement."""

    task: str
    clips: bool
    grid_per_category: int
    flip_columns: int
    scale: int

    @property
    def noun(self) -> str:
        """What one sample is called in a line: "clip" or "picture"."""
        return "clip" if self.clips else "picture"

    @property
    def extra_label(self) -> str:
        """What a sample's `extra` means, in a report's words."""
        if self.clips:
            return "clips with more objects than the prompt names"
        from omniroll.tasks.shapes.report import EXTRA_LABEL

        return EXTRA_LABEL

    @property
    def tags(self) -> tuple[str, ...]:
        """The world's categories, in its grammar's order."""
        if self.clips:
            from omniroll.tasks.moving_shapes.grammar import TAGS
        else:
            from omniroll.tasks.shapes.grammar import TAGS
        return TAGS

    def prompts_of(self, which: str) -> list[str]:
        """A split of the world's prompts ("train", "heldout", "all") or a file of them (ValueError naming every line
        outside the grammar, FileNotFoundError)."""
        if self.clips:
            from omniroll.tasks.moving_shapes.splits import prompts_of
        else:
            from omniroll.tasks.shapes.splits import prompts_of
        return prompts_of(which)

    def score(self, prompts: list[str], samples: list[np.ndarray], seeds: list[int]) -> list[Scored]:
        """One row per sample. ValueError when a sample is not what the world draws (a picture for a clip)."""
        shapes = {tuple(np.shape(s)) for s in samples}
        if any(len(s) != (4 if self.clips else 3) for s in shapes):
            wants = "clips [T, H, W, 3]" if self.clips else "pictures [H, W, 3]"
            raise ValueError(f"the {self.task} world scores {wants}, got samples of shape {sorted(shapes)[0]}")
        if self.clips:
            from omniroll.tasks.moving_shapes.report import score_clips

            return score_clips(prompts, samples, seeds)
        from omniroll.tasks.shapes.report import score_pictures

        return score_pictures(prompts, samples)

    def cell(self, sample: np.ndarray) -> np.ndarray:
        """What a grid shows of a sample: the picture, or the clip's film strip (frames left to right)."""
        if self.clips:
            from omniroll.tasks.moving_shapes.report import film_strip

            return film_strip(sample)
        return sample

    def caption(self, row: Scored, label: str = "") -> str:
        """A grid cell's caption (the verdict's mark is the grid's): the prompt, after `label` when given; for a
        clip that fails, also the checker's first reason."""
        text = f"{label}: {row.prompt}" if label else row.prompt
        return f"{text}; {row.reasons[0]}" if self.clips and not row.strict and row.reasons else text


#: task -> its world
WORLDS = {"shapes": EvalWorld("shapes", clips=False, grid_per_category=8, flip_columns=12, scale=2),
          "moving_shapes": EvalWorld("moving_shapes", clips=True, grid_per_category=4, flip_columns=4, scale=1)}


def world_for(task: str) -> EvalWorld:
    """The world of a task name; ValueError naming the known ones."""
    if task not in WORLDS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(WORLDS)}")
    return WORLDS[task]


def world_of(model_dir: str) -> EvalWorld:
    """The world the checkpoint at `model_dir` is evaluated in (its `omniroll_defaults.json`'s task; none: shapes)."""
    from omniroll.models.checkpoint import read_task

    return world_for(read_task(model_dir))
