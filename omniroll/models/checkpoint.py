"""What a checkpoint directory says before any weight loads: is it one (`require_checkpoint`), which pipeline
(`pipeline_class_name`), its limits (`ModelLimits`), its sampling defaults and its components' configs.

`ModelLimits` is the one place a request's resolution and text length are checked against a model: the adapter
builds it from its loaded modules, and `omniroll.models.read_limits(path)` builds the same object from the
checkpoint's config files alone (milliseconds), so a command can reject bad sampling parameters before a model or Ray
starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional


INDEX_FILE = "model_index.json"
#: the text-length ceiling when the tokenizer states none (T5's usual maximum in diffusers' SD3 pipeline)
DEFAULT_MAX_SEQUENCE_LENGTH = 512


def require_checkpoint(path: str, what: str = "path") -> str:
    """Return the path of `path`'s model_index.json; FileNotFoundError if `path` is not a diffusers checkpoint."""
    index = os.path.join(os.fspath(path), INDEX_FILE)
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{what} {os.fspath(path)!r} is not a diffusers checkpoint directory (no {INDEX_FILE})")
    return index


def read_model_index(path: str) -> dict:
    """model_index.json: the pipeline class and each component's (library, class) (ValueError when unreadable)."""
    index = require_checkpoint(path)
    try:
        with open(index) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {index}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"cannot read {index}: not a JSON object")
    return data


def pipeline_class_name(path: str) -> Optional[str]:
    """model_index.json's `_class_name` (ValueError when unreadable)."""
    return read_model_index(path).get("_class_name")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelLimits:
    """spatial_multiple: height and width must be multiples of it (VAE scale factor x patch size).
    max_resolution: largest height / width (positional embedding size x spatial_multiple); None: unbounded.
    max_sequence_length: largest text length in tokens."""

    spatial_multiple: int
    max_resolution: Optional[int]
    max_sequence_length: int

    def problems(self, height=None, width=None, max_sequence_length=None, prefix: str = "") -> list[str]:
        """One message per field that this model cannot take (fields given as None are not checked)."""
        out, mult, max_res = [], self.spatial_multiple, self.max_resolution
        for name, value in (("height", height), ("width", width)):
            if value is None:
                continue
            if not _is_int(value) or value <= 0 or value % mult:
                out.append(f"{prefix}{name} must be a positive multiple of {mult} (vae_scale_factor x patch_size), "
                           f"got {value!r}")
            elif max_res is not None and value > max_res:
                out.append(f"{prefix}{name} must be <= {max_res} (pos_embed_max_size x {mult}), got {value}")
        if max_sequence_length is not None:
            limit = self.max_sequence_length
            if not _is_int(max_sequence_length) or not 1 <= max_sequence_length <= limit:
                out.append(f"{prefix}max_sequence_length must be an int in [1, {limit}], got {max_sequence_length!r}")
        return out

    def check(self, height=None, width=None, max_sequence_length=None, prefix: str = "") -> None:
        """Raise ValueError naming every field this model cannot take."""
        problems = self.problems(height, width, max_sequence_length, prefix)
        if problems:
            raise ValueError("; ".join(problems))


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tokenizer_max_length(model_max_length) -> int:
    """A length limit read from a config (a tokenizer's `model_max_length`, a text encoder's
    `max_position_embeddings`) capped at DEFAULT_MAX_SEQUENCE_LENGTH; missing or unusable (tokenizers without one
    say 1e30): the default."""
    if _is_int(model_max_length) and 0 < model_max_length < DEFAULT_MAX_SEQUENCE_LENGTH:
        return model_max_length
    return DEFAULT_MAX_SEQUENCE_LENGTH


def tokenizer_padded_length(path: str, subfolder: str = "tokenizer") -> Optional[int]:
    """`model_max_length` of the checkpoint's `subfolder` tokenizer (CLIP: the length prompt ids are padded to), from
    its tokenizer_config.json; None when missing or unusable."""
    try:
        n = _read_json(os.path.join(path, subfolder, "tokenizer_config.json")).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    return n if _is_int(n) and 0 < n <= 4096 else None


def read_sd3_limits(path: str) -> ModelLimits:
    """The limits of the SD3-family checkpoint at `path`, from its config files only (no weights are read)."""
    require_checkpoint(path)
    try:
        vae = _read_json(os.path.join(path, "vae", "config.json"))
        transformer = _read_json(os.path.join(path, "transformer", "config.json"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model's config files under {os.fspath(path)!r}: {e}") from e
    mult = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1) * int(transformer.get("patch_size", 2))
    max_pos = transformer.get("pos_embed_max_size")
    seq = DEFAULT_MAX_SEQUENCE_LENGTH
    tok = os.path.join(path, "tokenizer_3", "tokenizer_config.json")
    if os.path.isfile(tok):
        try:
            seq = tokenizer_max_length(_read_json(tok).get("model_max_length"))
        except (OSError, ValueError):
            pass
    return ModelLimits(spatial_multiple=mult, max_resolution=None if max_pos is None else int(max_pos) * mult,
                       max_sequence_length=seq)


#: a checkpoint's own sampling defaults (optional): {"pipeline": {...}, "algo": {...}} in config keys, and the task
#: world it was trained on ({"task": "moving_shapes"}; `read_task`)
SAMPLING_DEFAULTS_FILE = "omniroll_defaults.json"
#: the task worlds a checkpoint can say it draws (`read_task`): the shapes world's pictures, the moving-shapes clips
TASKS = ("shapes", "moving_shapes")
#: the task of a checkpoint that states none (the shapes model, and every checkpoint made before `task` existed)
DEFAULT_TASK = "shapes"


def read_defaults_file(path: str) -> dict:
    """`omniroll_defaults.json` of the checkpoint directory at `path`, checked ({} when it has none): config sections
    ('pipeline', 'algo') as dicts, and 'task' one of TASKS. ValueError naming the file when it is malformed."""
    f = os.path.join(os.fspath(path), SAMPLING_DEFAULTS_FILE)
    if not os.path.isfile(f):
        return {}
    try:
        data = _read_json(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {f}: {e}") from e
    sections = {k: v for k, v in data.items() if k != "task"} if isinstance(data, dict) else None
    if sections is None or not set(sections) <= {"pipeline", "algo"} \
            or not all(isinstance(v, dict) for v in sections.values()):
        raise ValueError(f"{f} must map 'pipeline' and / or 'algo' to dicts of config keys, got {data!r}")
    if "task" in data and data["task"] not in TASKS:
        raise ValueError(f"{f}: 'task' must be one of {list(TASKS)}, got {data['task']!r}")
    return data


def read_sampling_defaults(path: str) -> dict:
    """The sampling defaults a checkpoint directory states in `omniroll_defaults.json` (e.g. the shapes model: its
    64 x 64 resolution and 12-token text), as a dict of config sections; {} when it states none. Config loading puts
    them under what the user sets, above the schema's defaults. ValueError naming the file when it is malformed."""
    return {k: v for k, v in read_defaults_file(path).items() if k != "task"}


def read_task(path: str) -> str:
    """The task world the checkpoint at `path` draws for, one of TASKS: `omniroll_defaults.json`'s `task` (written by
    `omniroll pretrain shapes-video`: "moving_shapes"), DEFAULT_TASK when it states none. The one place evaluation
    learns which prompts and checker a model is judged with."""
    return read_defaults_file(path).get("task", DEFAULT_TASK)


def read_component_configs(path: str, *components: str) -> list[dict]:
    """The config.json of each component directory (ValueError naming the directory when unreadable)."""
    require_checkpoint(path)
    try:
        return [_read_json(os.path.join(path, c, "config.json")) for c in components]
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model's config files under {os.fspath(path)!r}: {e}") from e
