"""The shapes model: a small SD3 (VAE, transformer, two CLIPs and a T5) trained from scratch on the shapes world
(`omniroll.tasks.shapes`), shipped with the package so that `--model shapes` works offline in seconds.

`checkpoint_dir()` is the shipped diffusers checkpoint directory (its files are checked once per process against
`SHA256SUMS`: `omniroll.models.shipped`); `omniroll pretrain shapes --out DIR` (`make shapes-model`) trains one from
scratch with the recipe in `recipe.py`. One file per part: `data.py` (captioned scenes), `text.py` (tokenizers,
frozen text encoders), `vae.py`, `dit.py` (the transformer), `assemble.py` (the pipeline directory), `recipe.py` (the
settings that made the shipped model), `pretrain.py` (the whole run).
"""

from __future__ import annotations

import functools
import os

from omniroll.models.shipped import verified

#: the shipped checkpoint, inside the package
CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint")
#: what `verified` calls it, and the command that makes it
WHAT, REMAKE = "the shapes model", "make shapes-model"


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> str:
    """The shipped shapes checkpoint directory, verified (once per process: `checkpoint_dir.cache_clear()` after
    installing a new one)."""
    return verified(CHECKPOINT, WHAT, REMAKE)
