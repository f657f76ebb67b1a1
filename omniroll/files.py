"""Files every command writes: atomic writes (mode 0644) of files and of whole directories, JSON-safe values,
`run_info` (what made a file), and `cache_dir` (where omniroll keeps what a later run may reuse).

The trajectory layout itself is `omniroll.trajectory_file`; these writers know nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
from typing import Any, Iterator, Optional

FILE_MODE = 0o644


def cache_dir() -> str:
    """`$OMNIROLL_CACHE_DIR` (default `~/.cache/omniroll`): the engines' row calibrations, the kept evaluations."""
    return os.environ.get("OMNIROLL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "omniroll")


def tiny_model_cache_dir() -> str:
    """`$OMNIROLL_CACHE` (default `.omniroll_cache`, under the working directory): where `--model tiny` and the other
    tiny families build their checkpoints once."""
    return os.environ.get("OMNIROLL_CACHE", ".omniroll_cache")


def write_bytes(path: str, data: bytes) -> str:
    """Write `data` to `path` atomically (a temporary file in the same directory, then a rename), mode 0644. A failed
    write leaves no partial file and raises `OutputWriteError` naming the path and why (e.g. no space left)."""
    from omniroll.errors import OutputWriteError

    try:
        return _write_atomic(path, data)
    except OSError as e:
        raise OutputWriteError(path, e) from e


def _write_atomic(path: str, data: bytes) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def staged_directory(target: str, prefix: str = ".tmp-") -> Iterator[str]:
    """A directory written whole or not at all: yields a new temporary directory beside `target` to write into; when
    the block ends normally it replaces `target` (a directory already there is removed first), and when the block
    raises (or is interrupted) it is removed and `target` stays as it was."""
    target = os.path.abspath(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix + os.path.basename(target) + ".", dir=os.path.dirname(target))
    try:
        yield tmp
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str, text: str) -> str:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj: Any) -> str:
    return write_text(path, json.dumps(jsonable(obj), indent=1) + "\n")


def jsonable(x: Any) -> Any:
    """A JSON-safe copy: numpy scalars to Python, non-finite floats to None, unknown objects to their repr."""
    import math

    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "shape", None) == ():
        x = x.item()
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x if isinstance(x, (str, int, float, bool)) or x is None else repr(x)


def package_versions() -> dict:
    """Versions of what decides the numbers: omniroll, Python, torch, diffusers, transformers, safetensors."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("omniroll", "torch", "diffusers", "transformers", "safetensors", "ray"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_info(command: str, model: str, device: str, dtype: str, batch_invariant: bool, seed: Optional[int],
             **extra) -> dict:
    """What made a file: recorded in the trajectory file's `run` metadata and in metrics.json."""
    return {"command": command, "model": os.path.abspath(model) if os.path.isdir(model) else model,
            "device": device, "dtype": str(dtype).removeprefix("torch."), "batch_invariant": bool(batch_invariant),
            "seed": seed, "versions": package_versions(), "machine": platform.machine(),
            "env_overrides": os.environ.get("OMNIROLL_OVERRIDES") or None, **extra}
