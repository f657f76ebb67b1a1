"""One way to turn a pydantic `ValidationError` into the user's words (no pydantic URLs, no multi-line dumps).

Every layer that validates with pydantic (sampling parameters, requests, the YAML config) formats its errors here, so
a bad field reads the same wherever it was caught: `dotted.key: what is wrong (got value)`.
"""

from __future__ import annotations

import errno as _errno
import re
from typing import Any, Callable, Optional

#: a shown input longer than this is cut (errors must never echo a whole prompt or request body back)
MAX_SHOWN_INPUT = 80


def _shown(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= MAX_SHOWN_INPUT else r[:MAX_SHOWN_INPUT - 3] + "..."


def validation_messages(error, prefix: str = "", with_input: bool = True, empty_loc: Optional[str] = None,
                        locate: Optional[Callable[[tuple], str]] = None) -> list[str]:
    """One line per error of `error` (a pydantic ValidationError): `prefix.loc: msg (got input)`.

    prefix: dotted path the model sits at (e.g. "sampling_params"). with_input: append the offending value (cut to
    MAX_SHOWN_INPUT characters; never for whole-model errors). empty_loc: the key named when pydantic gives no location
    (a model-level validator); None prints the message alone. locate: maps pydantic's loc tuple to a dotted key
    (default: the parts joined by dots).
    """
    lines = []
    for err in error.errors():
        loc = tuple(err.get("loc") or ())
        key = locate(loc) if locate is not None else ".".join(str(p) for p in loc)
        key = ".".join(p for p in (prefix, key) if p) if key else (empty_loc or "")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        line = f"{key}: {msg}" if key else msg
        if with_input and loc and "input" in err and ", got " not in msg:  # a validator's own message may say it
            line += f" (got {_shown(err['input'])})"
        lines.append(line)
    return lines


def format_validation_error(error, prefix: str = "", with_input: bool = True, empty_loc: Optional[str] = None,
                            locate: Optional[Callable[[tuple], str]] = None, sep: str = "; ") -> str:
    """`validation_messages` joined into one string (one error per `sep`)."""
    return sep.join(validation_messages(error, prefix, with_input, empty_loc, locate))


class OutputWriteError(OSError):
    """An output file could not be written (disk full, file too large, quota, permissions): names the file and why.
    The CLI reports it with what was kept (`omniroll.cli.main`)."""

    def __init__(self, path: str, error: OSError):
        code = _errno.errorcode.get(error.errno, "") if error.errno else ""
        reason = error.strerror or str(error) or type(error).__name__
        super().__init__(f"could not write {path}: {reason}" + (f" ({code})" if code else ""))
        self.path, self.errno = path, error.errno


_SUBKEY = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*): (.+)$", re.S)


def config_messages(error, root: Optional[type] = None) -> list[str]:
    """One `dotted.key: what is wrong` per problem. A section's validator that names its own key in its message
    (`height: must be ...`, `kwargs.model_dir: directory not found: ...`) is reported under the full key
    (`pipeline.height: ...`); several problems joined by "; " in one message become one line each. With `root` (the
    validated model class), an unknown key names the nearest key of its section: `pipeline.heigth: Extra inputs are
    not permitted (did you mean pipeline.height?)`."""
    out = []
    for err, line in zip(error.errors(), validation_messages(error)):
        key = ".".join(str(p) for p in err.get("loc") or ())
        if root is not None and err.get("type") == "extra_forbidden":
            near = nearest_key(root, tuple(err["loc"]))
            if near:
                msg = str(err.get("msg", ""))
                line = line.replace(msg, f"{msg} (did you mean {near}?)", 1)
        parts = str(err.get("msg", "")).removeprefix("Value error, ").split("; ")
        if not key or not any(_SUBKEY.match(p) for p in parts):
            out.append(line)
            continue
        for part in parts:
            m = _SUBKEY.match(part)
            out.append(f"{key}.{m.group(1)}: {m.group(2)}" if m else f"{key}: {part}")
    return out


def nearest_key(root: type, loc: tuple) -> Optional[str]:
    """The dotted key of the field of `loc[:-1]`'s section (in the pydantic model class `root`) nearest to the unknown
    key `loc[-1]`, or None when none is close (difflib's ratio >= 0.6)."""
    import difflib

    section = root
    for part in loc[:-1]:
        section = _child(section, str(part))
        if section is None:
            return None
    fields = next((list(a.model_fields) for a in _arms(section) if isinstance(getattr(a, "model_fields", None), dict)),
                  [])
    match = difflib.get_close_matches(str(loc[-1]), fields, n=1, cutoff=0.6)
    return ".".join([*map(str, loc[:-1]), match[0]]) if match else None


def _arms(annotation) -> list:
    """The types an annotation may hold: a Union's (or Optional's) members, an Annotated's type, or itself."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _arms(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [arm for a in typing.get_args(annotation) if a is not type(None) for arm in _arms(a)]
    return [annotation]


def _child(annotation, part: str):
    """The annotation `part` of a value of `annotation` holds: a model's field, a dict's value or a list's item."""
    import typing

    for arm in _arms(annotation):
        fields = getattr(arm, "model_fields", None)
        if isinstance(fields, dict):
            if part in fields:
                return fields[part].annotation
        elif typing.get_origin(arm) in (dict, list) and typing.get_args(arm):
            return typing.get_args(arm)[-1]
    return None
