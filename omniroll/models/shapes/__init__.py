"""The shapes model: a small SD3 (VAE, transformer, two CLIPs and a T5) trained from scratch on the shapes world
(`omniroll.tasks.shapes`), shipped with the package so that `--model shapes` works offline in seconds.

`checkpoint_dir()` is the shipped diffusers checkpoint directory (its files are checked once per process against
`SHA256SUMS`); `omniroll pretrain shapes --out DIR` (`make shapes-model`) trains one from scratch with the recipe in
`recipe.py`. One file per part: `data.py` (captioned scenes), `text.py` (tokenizers, frozen text encoders), `vae.py`,
`dit.py` (the transformer), `assemble.py` (the pipeline directory), `recipe.py` (the settings that made the shipped
model), `pretrain.py` (the whole run).
"""

from __future__ import annotations

import functools
import hashlib
import os

#: the shipped checkpoint, inside the package
CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint")
SUMS_FILE = "SHA256SUMS"


def file_digests(path: str) -> dict[str, str]:
    """{relative path: sha256} of every file under `path` except the sums file itself (sorted)."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            full = os.path.join(d, f)
            rel = os.path.relpath(full, path)
            if rel == SUMS_FILE or f.startswith("."):
                continue
            with open(full, "rb") as fh:
                out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return dict(sorted(out.items()))


def write_sums(path: str) -> str:
    """Write `SHA256SUMS` (sha256sum's format) for the checkpoint at `path`; returns its path."""
    sums = os.path.join(path, SUMS_FILE)
    with open(sums, "w") as f:
        for rel, digest in file_digests(path).items():
            f.write(f"{digest}  {rel}\n")
    return sums


@functools.lru_cache(maxsize=None)
def verified(path: str, what: str = "the shapes model", remake: str = "make shapes-model") -> str:
    """`path` when its files match its `SHA256SUMS`; FileNotFoundError naming what is missing or changed (a clone
    without the weights, say, or a checkout that stored them as Git LFS pointers), `what` the model is and the
    command that makes it again (`remake`)."""
    sums = os.path.join(path, SUMS_FILE)
    if not os.path.isfile(sums):
        raise FileNotFoundError(f"{what} is missing: no {sums} (retrain it with `{remake}`)")
    with open(sums) as f:
        want = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f if line.strip())
    have = file_digests(path)
    bad = sorted(rel for rel, digest in want.items() if have.get(rel) != digest)
    if bad:
        raise FileNotFoundError(f"{what} at {path} does not match its {SUMS_FILE}: {', '.join(bad[:4])} "
                                f"missing or changed (restore them from git, or retrain with `{remake}`)")
    return path


def checkpoint_dir() -> str:
    """The shipped shapes checkpoint directory, verified."""
    return verified(CHECKPOINT)
