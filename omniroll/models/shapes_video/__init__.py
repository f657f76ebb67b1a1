"""The shapes-video model: a small Wan 2.1 (diffusers' `AutoencoderKLWan`, `WanTransformer3DModel`, a frozen random
text encoder: a BERT, whose positions let the transformer read word order) trained from scratch on the moving-shapes
world (`omniroll.tasks.moving_shapes`), so that a video algorithm can be judged on a CPU. The saved checkpoint is a
plain diffusers `WanPipeline` directory that the Wan adapter loads with no special path.

`omniroll pretrain shapes-video --out DIR` (`make shapes-video-model`) trains one with the recipe in `recipe.py`,
resumably (`resume.py`: a rerun with the same DIR continues where it stopped and ends bitwise where an uninterrupted
run ends); `--install` copies it to `CHECKPOINT` (`install`), where `--model shapes-video` finds it
(`checkpoint_dir`). One file per part: `data.py` (training clips, a pure function of seed and step), `text.py` (the
tokenizer and frozen encoder), `vae.py` (the video VAE, its decode without the clamp), `dit.py` (the transformer),
`recipe.py`, `resume.py`, `pretrain.py` (the whole run).
"""

from __future__ import annotations

import functools
import os

#: where the shipped checkpoint lives, inside the package (empty until `omniroll pretrain shapes-video --install`)
CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint")
#: what `verified` calls it, and the command that makes it
WHAT, REMAKE = "the shapes-video model", "make shapes-video-model"


@functools.lru_cache(maxsize=None)
def checkpoint_dir(path: str = CHECKPOINT) -> str:
    """The shipped shapes-video checkpoint directory (`path`), verified against its SHA256SUMS (once per process and
    path). FileNotFoundError saying how to make it while none is shipped (a checkpoint directory works as `--model`
    meanwhile)."""
    from omniroll.models.shipped import SUMS_FILE, verified

    if not os.path.isfile(os.path.join(path, SUMS_FILE)):
        raise FileNotFoundError(
            f"the shapes-video model is not shipped yet (no {os.path.join(path, SUMS_FILE)}): make it with `{REMAKE}` "
            f"(hours on 2 cores, resumable; `omniroll pretrain shapes-video --out DIR --install` puts it here), or "
            f"pass a checkpoint directory meanwhile, e.g. --model out/shapes-video-model/checkpoint (`omniroll "
            f"pretrain shapes-video --toy --out DIR` makes a toy one in a minute)")
    return verified(path, WHAT, REMAKE)


def install(source: str, path: str = CHECKPOINT) -> str:
    """Copy the checkpoint at `source` (verified; made by `omniroll pretrain shapes-video`: its task is the
    moving-shapes world) over `path`, and verify the copy (`omniroll.models.shipped.install`). ValueError naming what
    is wrong with `source`, before anything at `path` changes."""
    from omniroll.models.checkpoint import read_task
    from omniroll.models.shipped import install as install_files

    def moving_shapes(checkpoint: str) -> None:
        task = read_task(checkpoint)
        if task != "moving_shapes":
            raise ValueError(f"{checkpoint} says its task is {task!r}, not 'moving_shapes' (a checkpoint saved "
                             f"before omniroll_defaults.json named its task: run `omniroll pretrain shapes-video "
                             f"--out` on its run directory again, which re-saves a finished run's checkpoint with the "
                             f"current code)")

    out = install_files(source, path, WHAT, REMAKE, check=moving_shapes)
    checkpoint_dir.cache_clear()
    return out
