"""Model files shipped inside the package (the shapes model, the shapes-video model, the shapes proxy): each directory
carries a `SHA256SUMS` (`write_sums`), is checked against it before use (`verified`), and a new one replaces the
shipped one only through `install(source, dest)`: verified before anything at `dest` changes, then verified again.

    write_sums(out)                                             # after a pretraining saved its files
    verified(CHECKPOINT, "the shapes model", "make shapes-model")   # FileNotFoundError naming what changed
    install(new, CHECKPOINT, "the shapes model", "make shapes-model")
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Callable, Optional

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
    """Write `SHA256SUMS` (sha256sum's format) for the files at `path`; returns its path."""
    sums = os.path.join(path, SUMS_FILE)
    with open(sums, "w") as f:
        for rel, digest in file_digests(path).items():
            f.write(f"{digest}  {rel}\n")
    return sums


def verified(path: str, what: str, remake: str, required: tuple[str, ...] = ()) -> str:
    """`path` when its files match its `SHA256SUMS` and it lists every one of `required`; FileNotFoundError naming
    what is missing or changed (a clone without the weights, say, or a checkout that stored them as Git LFS
    pointers), `what` the files are and the command that makes them again (`remake`). It reads every file each
    call: a caller that asks often keeps the answer (`omniroll.models.shapes.checkpoint_dir`)."""
    sums = os.path.join(path, SUMS_FILE)
    if not os.path.isfile(sums):
        raise FileNotFoundError(f"{what} at {path} is missing its {SUMS_FILE} (retrain it with `{remake}`)")
    with open(sums) as f:
        want = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f if line.strip())
    have = file_digests(path)
    bad = sorted({rel for rel, digest in want.items() if have.get(rel) != digest}
                 | {rel for rel in required if rel not in want})
    if bad:
        raise FileNotFoundError(f"{what} at {path} does not match its {SUMS_FILE}: {', '.join(bad[:4])} "
                                f"missing or changed (restore them from git, or retrain with `{remake}`)")
    return path


def install(source: str, dest: str, what: str, remake: str, required: tuple[str, ...] = (),
            check: Optional[Callable[[str], None]] = None) -> str:
    """Copy the files at `source` over the shipped ones at `dest` and return `dest`, verified. `source` is verified
    first (and given to `check`, which raises ValueError naming what is wrong with it) before anything at `dest`
    changes."""
    verified(source, f"the files at {source}", remake, required)
    if check is not None:
        check(source)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    return verified(dest, what, remake, required)
