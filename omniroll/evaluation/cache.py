"""Evaluations kept on disk and reused: the pictures (or clips) an engine draws for a list of prompts and seeds, stored
under a key that says what drew them, read back only after a few of them were drawn again and found bitwise equal.

The key is the sha256 of the engines' `sample_identity()` (their weights' digest, execution mode, decode block, device,
threads, library versions), the sampling and the (prompt, seed) list. An entry is a directory `<root>/<key>/`:
`pictures.png` (the pictures side by side in rows of `COLUMNS`, lossless; a clip [T, H, W, 3] is one cell, its film
strip of T frames left to right, and `frames` in entry.json says T) and `entry.json` (what the key was made of and every
picture's prompt, seed and sha256, of the picture's or the clip's array). Reading an entry checks every picture's
digest: a damaged file is a miss. No key can see a change in the code that draws, so the caller draws `check_indices`
again and compares them with the entry before using it. Bitwise equal (`matches`): the entry is read. Another machine's
CPU kernels move pictures in their last bits without changing what they show, so an entry is also read when the pictures
drawn again differ from it only that way (`agree_in_verdicts`): every one has the stored picture's exact verdicts (pass
or fail, partial credit, the checker's reasons) and differs from it by at most `NEAR_LEVELS` on average (the same
picture, not another one). Otherwise the evaluation is drawn whole and the entry replaced. The pairing that reads an
entry afterwards compares verdicts at the same (prompt, seed), which is what this check guarantees on its sample. Only
batch-invariant engines are eligible (`eligible`): elsewhere a picture depends on its batch. The root:
`$OMNIROLL_CACHE_DIR/evaluations` (default `~/.cache/omniroll/evaluations`). A model directory may ship entries of its
own in `evaluations/` (`SHIPPED`; the shapes model ships the demo's, so a first `make demo` reads its evaluation before
training too): read after the root, never written. The root holds at most `MAX_BYTES` (2 GiB): writing an entry removes
the least recently used ones beyond it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from omniroll.evaluation.shapes import Evaluation, eval_seed, scored
from omniroll.files import cache_dir, staged_directory

COLUMNS = 32  # pictures per row of pictures.png
CHECKED = 8  # pictures drawn again before an entry is used
MAX_BYTES = 2 << 30  # the root's entries beyond this, least recently used first, are removed when one is written
SHIPPED = "evaluations"  # a model directory's own entries
NEAR_LEVELS = 2.0  # the largest mean |difference| (of 255) between a stored picture and one drawn again with the same
# verdicts for the entry to be read: last bits move a few pixels by a level or two, another picture moves many more


def cache_root() -> Path:
    """`$OMNIROLL_CACHE_DIR/evaluations` (default `~/.cache/omniroll/evaluations`)."""
    return Path(cache_dir()) / "evaluations"


def eligible(identities: list[dict]) -> Optional[dict]:
    """The one identity every engine has, when they all have it and draw batch-invariantly; else None (no cache)."""
    if not identities or any(i != identities[0] for i in identities[1:]):
        return None
    return identities[0] if identities[0].get("execution", {}).get("batch_invariant") else None


def entry_key(identity: dict, sampling: dict, prompts: list[str], seeds: list[int]) -> str:
    """sha256 (hex) of what the pictures depend on: the engines' identity, the sampling, the (prompt, seed) list."""
    about = {"identity": identity, "sampling": sampling, "pictures": [[p, int(s)] for p, s in zip(prompts, seeds)]}
    return hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()


def check_indices(n: int, count: int = CHECKED) -> list[int]:
    """`count` picture indices spread evenly over `n` (all of them when n <= count): the pictures drawn again."""
    if n <= count:
        return list(range(n))
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def picture_digest(picture: np.ndarray) -> str:
    """sha256 (hex) of a picture's [H, W, 3] or a clip's [T, H, W, 3] bytes."""
    return hashlib.sha256(np.ascontiguousarray(picture).tobytes()).hexdigest()


def to_cell(sample: np.ndarray) -> np.ndarray:
    """A sample as its cell of pictures.png: the picture, or the clip's frames left to right [H, T * W, 3]."""
    if sample.ndim == 3:
        return sample
    t, h, w, c = sample.shape
    return sample.transpose(1, 0, 2, 3).reshape(h, t * w, c)


def from_cell(cell: np.ndarray, frames: Optional[int]) -> np.ndarray:
    """`to_cell`'s inverse: the picture, or the clip [T, H, W, 3] of `frames` frames (None: a picture)."""
    if frames is None:
        return np.ascontiguousarray(cell)
    h, tw, c = cell.shape
    return np.ascontiguousarray(cell.reshape(h, frames, tw // frames, c).transpose(1, 0, 2, 3))


def matches(stored: list[np.ndarray], drawn: list[np.ndarray]) -> bool:
    """Every drawn picture equals the stored one bitwise (shape, dtype and bytes)."""
    return len(stored) == len(drawn) and all(
        a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(stored, drawn))


def cpu_kernels() -> str:
    """What decides a picture's last bits on this machine beyond the key: the CPU instruction set torch's kernels use
    ("AVX512", "AVX2", ...) and the machine's architecture; kept in each entry it writes (`drawn_on`)."""
    import platform

    import torch

    return f"{torch.backends.cpu.get_cpu_capability()} on {platform.machine()}"


def mean_levels(a: np.ndarray, b: np.ndarray) -> float:
    """The mean absolute difference of two uint8 pictures of one shape, in levels of 255."""
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def agree_in_verdicts(stored: list[dict], drawn: list[dict], stored_pictures: list[np.ndarray],
                      drawn_pictures: list[np.ndarray], near: float = NEAR_LEVELS) -> bool:
    """The pictures drawn again show what the stored ones show: the same verdict records (`Evaluation.
    picture_records`: prompt, seed, pass or fail, partial credit, reasons) one by one, and pictures of one shape that
    differ by at most `near` levels on average."""
    return (len(stored) == len(drawn) == len(stored_pictures) == len(drawn_pictures) and stored == drawn
            and all(a.shape == b.shape and mean_levels(a, b) <= near
                    for a, b in zip(stored_pictures, drawn_pictures)))


class EvaluationCache:
    """The entries under `root` (default `cache_root()`), then under each of `read_only` (a model's `SHIPPED`)."""

    def __init__(self, root: Optional[str | Path] = None, read_only: Sequence[str | Path] = (),
                 max_bytes: int = MAX_BYTES):
        self.root = Path(root) if root is not None else cache_root()
        self.read_only = [Path(p) for p in read_only]
        self.max_bytes = max_bytes

    @classmethod
    def for_model(cls, model_dir: str) -> "EvaluationCache":
        """The user's entries (`cache_root()`), then those `model_dir` ships in its `SHIPPED` folder."""
        return cls(read_only=[os.path.join(model_dir, SHIPPED)])

    def load(self, key: str, prompts: list[str], seeds: list[int]) -> Optional[tuple[list[np.ndarray], Path]]:
        """(the entry's pictures in the order of (`prompts`, `seeds`), its folder) from the first root that has a
        good one, or None: no entry, another picture list, or a picture whose bytes do not match its digest."""
        for root in (self.root, *self.read_only):
            pictures = self.read(root / key, prompts, seeds)
            if pictures is not None:
                if root == self.root:
                    with contextlib.suppress(OSError):
                        os.utime(root / key / "entry.json")  # used now: the last to be pruned
                return pictures, root / key
        return None

    @staticmethod
    def read(folder: Path, prompts: list[str], seeds: list[int]) -> Optional[list[np.ndarray]]:
        """The pictures of the entry in `folder` (see `load`), or None."""
        from PIL import Image

        try:
            entry = json.loads((folder / "entry.json").read_text())
            atlas = np.asarray(Image.open(folder / "pictures.png").convert("RGB"))
            records = entry["pictures"]
            listed = [(r["prompt"], int(r["seed"])) for r in records]
            h, w = int(entry["height"]), int(entry["width"])
            frames = int(entry["frames"]) if "frames" in entry else None  # a clip's; pictures have none
        except (OSError, ValueError, KeyError, TypeError):  # missing, unreadable or not an entry: a miss
            return None
        if listed != [(p, int(s)) for p, s in zip(prompts, seeds)] or (frames is not None and frames < 1):
            return None
        cw = w * (frames or 1)  # a cell's width
        pictures = []
        for i, r in enumerate(records):
            y, x = (i // COLUMNS) * h, (i % COLUMNS) * cw
            cell = atlas[y:y + h, x:x + cw]
            if cell.shape != (h, cw, 3):
                return None
            picture = from_cell(cell, frames)
            if picture_digest(picture) != r["sha256"]:
                return None
            pictures.append(picture)
        return pictures

    def store(self, key: str, about: dict, prompts: list[str], seeds: list[int],
              pictures: list[np.ndarray]) -> Optional[Path]:
        """Write the entry (atomically: a half-written entry never exists); None when it cannot be written (the run
        goes on; the evaluation is drawn again next time). `about` (identity, sampling) goes into entry.json."""
        from PIL import Image

        if not pictures or any(p.dtype != np.uint8 or p.ndim not in (3, 4) or p.shape[-1] != 3
                               or p.shape != pictures[0].shape for p in pictures):
            return None
        clips = pictures[0].ndim == 4
        h, w = pictures[0].shape[-3:-1]
        cells = [to_cell(p) for p in pictures]
        cw = cells[0].shape[1]
        rows = -(-len(cells) // COLUMNS)
        atlas = np.zeros((rows * h, min(len(cells), COLUMNS) * cw, 3), dtype=np.uint8)
        for i, cell in enumerate(cells):
            atlas[(i // COLUMNS) * h:(i // COLUMNS + 1) * h, (i % COLUMNS) * cw:(i % COLUMNS + 1) * cw] = cell
        entry = {**about, "height": h, "width": w, **({"frames": pictures[0].shape[0]} if clips else {}), "pictures": [
            {"prompt": pr, "seed": int(s), "sha256": picture_digest(p)} for pr, s, p in zip(prompts, seeds, pictures)]}
        target = self.root / key
        try:
            with staged_directory(str(target), prefix=".") as tmp:  # an entry that failed its check is replaced
                Image.fromarray(atlas).save(os.path.join(tmp, "pictures.png"))
                with open(os.path.join(tmp, "entry.json"), "w") as f:
                    f.write(json.dumps(entry, indent=1) + "\n")
        except OSError:
            return None
        self.prune(keep=key)
        return target

    def prune(self, keep: str) -> list[str]:
        """Remove the root's least recently used entries (by their entry.json's time: written or last read) until
        the rest fit in `max_bytes`, never `keep`; returns the keys removed."""
        entries = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            with contextlib.suppress(OSError):
                if folder.is_dir() and not folder.name.startswith("."):
                    size = sum(f.stat().st_size for f in folder.iterdir())
                    entries.append(((folder / "entry.json").stat().st_mtime, size, folder))
        total, removed = sum(size for _, size, _ in entries), []
        for _, size, folder in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if folder.name != keep:
                shutil.rmtree(folder, ignore_errors=True)
                total -= size
                removed.append(folder.name)
        return removed


def drawn_on(folder: Path) -> str:
    """The `cpu_kernels()` of the machine that wrote the entry in `folder` ("an unrecorded CPU" for an older one)."""
    try:
        return str(json.loads((folder / "entry.json").read_text())["drawn_on"])
    except (OSError, ValueError, KeyError, TypeError):
        return "an unrecorded CPU"


def evaluate_kept(cache: EvaluationCache, identity: dict, sampling: dict, prompts: list[str], seeds: int,
                  base_seed: int, draw: Callable[[Optional[list[int]], int], Evaluation]) -> tuple[Evaluation, dict]:
    """The evaluation of every prompt at `seeds` seeds (`eval_seed(base_seed, prompt, j)`), read from `cache` when an
    entry has it and its pictures at `check_indices` of the prompts (their first seed), drawn again, are bitwise
    equal or agree in their verdicts (`agree_in_verdicts`: another machine's last bits); else drawn whole and kept in
    `cache.root` (replacing an entry that did not agree). `draw(indices, n)` draws the prompts at `indices` (None:
    all) `n` times each, in order, with the engines `identity` describes, as an `Evaluation` (pictures or clips: the
    stored ones are scored in its world). Returns it with `{"key", "read", "checked", "agreed", "note"}`: `agreed`
    is "bits", "verdicts" or None (not read); the note, one console line saying which."""
    order = [(p, eval_seed(base_seed, p, j)) for p in prompts for j in range(seeds)]
    names, numbers = [p for p, _ in order], [s for _, s in order]
    key = entry_key(identity, sampling, names, numbers)
    found = cache.load(key, names, numbers)
    info = {"key": key, "read": False, "checked": 0, "agreed": None}
    if found is not None:
        stored, folder = found
        chosen = check_indices(len(prompts))
        again = draw(chosen, 1)
        info["checked"] = len(chosen)
        kept = [stored[i * seeds] for i in chosen]
        if list(zip(again.prompts, again.seeds)) == [order[i * seeds] for i in chosen]:
            if matches(kept, again.pictures):
                return scored(stored, names, numbers, again.task), {**info, "read": True, "agreed": "bits", "note": (
                    f"read from the evaluation cache, {len(chosen)} of its {len(stored)} pictures drawn again: "
                    f"bitwise equal ({folder})")}
            checked = scored(kept, again.prompts, again.seeds, again.task)
            if agree_in_verdicts(checked.picture_records(), again.picture_records(), kept, again.pictures):
                worst = max(mean_levels(a, b) for a, b in zip(kept, again.pictures))
                ev = scored(stored, names, numbers, again.task)
                return ev, {**info, "read": True, "agreed": "verdicts", "note": (
                    f"read from the evaluation cache, {len(chosen)} of its {len(stored)} pictures drawn again: "
                    f"other last bits (at most {worst:.2f} levels apart on average: another machine's CPU kernels), "
                    f"every verdict the same; drawn on {drawn_on(folder)}, here {cpu_kernels()} ({folder})")}
        note = (f"warning: the evaluation cache's entry {folder} differs from {len(chosen)} of its pictures drawn "
                f"again, in what they show (another model, or a change to the code that draws?): drawn whole, and "
                f"kept in {cache.root}")
    else:
        note = "drawn, and kept in the evaluation cache for a run with the same weights, sampling and seeds"
    ev = draw(None, seeds)
    if list(zip(ev.prompts, ev.seeds)) != order:  # never expected: the key would not name these pictures
        note = "drawn, not kept in the evaluation cache: its seeds are not the ones the key names"
    elif cache.store(key, {"identity": identity, "sampling": sampling, "drawn_on": cpu_kernels()}, names, numbers,
                     ev.pictures) is None:
        note = f"drawn, not kept in the evaluation cache: {cache.root} could not be written"
    return ev, {**info, "note": note}
