"""The text of the generated documentation: the reference pages and the parts of hand-written pages that are built
from the code, so that they cannot drift from it. `docs/hooks/generated.py` lists where each goes and writes them.

- `config_reference`: every key of the YAML config (`omniroll.config.OmniRollConfig`): type, allowed values,
  default, description and the command-line flag that sets it (`omniroll.cli.common.FLAGS`), plus each training
  algorithm's own options (`omniroll.config.algorithms.ALGORITHMS`). A key without a description is an error.
- `cli_reference`: every command's flags, from the parsers `omniroll` itself builds.
- `engine_reference`: `SamplingParams` (per request) and `EngineConfig` (per engine; `engine.*` and `engine.kwargs.*`
  in the YAML), from the classes; a field without a description is an error.
- `algorithm_table`: one algorithm's options table (its page's "Options and defaults").
- `file_map`: every module of `omniroll/` with the first sentence of its docstring (the design page).
"""

from __future__ import annotations

import argparse
import ast
import re
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ types and values
def _unwrap(annotation):
    """(the annotation without Optional / Annotated, its bounds, whether None is allowed)."""
    bounds, optional = [], False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            base, *meta = typing.get_args(annotation)
            for m in meta:
                bounds += list(getattr(m, "metadata", [])) if hasattr(m, "metadata") else [m]
            annotation = base
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            optional |= len(args) < len(typing.get_args(annotation))
            if len(args) != 1:
                return annotation, bounds, optional
            annotation = args[0]
        else:
            return annotation, bounds, optional


def _type_name(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal and len(typing.get_args(annotation)) == 1:
        return f"`{typing.get_args(annotation)[0]}`"
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(_unwrap(a)[0]) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(_unwrap(a)[0]) for a in typing.get_args(annotation))
        return f"{typing.get_origin(annotation).__name__}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _range(bounds) -> str:
    words = {Ge: (">=", "ge"), Gt: (">", "gt"), Le: ("<=", "le"), Lt: ("<", "lt")}
    out = []
    for b in bounds:
        for cls, (word, attr) in words.items():
            if isinstance(b, cls):
                out.append(f"{word} {getattr(b, attr)}")
        if isinstance(b, MinLen):
            out.append(f"length >= {b.min_length}")
        if isinstance(b, MaxLen):
            out.append(f"length <= {b.max_length}")
    return ", ".join(out)


def _default(field) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is None:
            return "required"
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def _cell(text: str) -> str:
    """`text` for a table cell: one line, `|` escaped, `<` and `>` outside code spans as entities (GitHub and
    Markdown would read `<family>` as an HTML tag and drop it), `$` escaped (not math)."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;").replace("$", "\\$")
                    for i, p in enumerate(parts))


# ------------------------------------------------------------------------------------------- the config reference
def _section_model(annotation):
    """The section class of a field (a model, an optional model, or a dict of models), else None."""
    base, _, _ = _unwrap(annotation)
    if isinstance(base, type) and issubclass(base, BaseModel):
        return base, ""
    if typing.get_origin(base) is dict:
        value = _unwrap(typing.get_args(base)[1])[0]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value, "<name>."
    return None, ""


def _row(key: str, field, flags: dict, missing: list) -> str:
    if not field.description:
        missing.append(key)
    base, bounds, optional = _unwrap(field.annotation)
    kind = _type_name(base) + (" or `null`" if optional else "")
    flag = flags.get(key, "")
    return (f"| `{key}` | {_cell(kind)} | {_range(bounds + list(field.metadata))} | {_cell(_default(field))} "
            f"| {_cell(field.description or '')} | {f'`{flag}`' if flag else ''} |")


def _rows(model, prefix: str, flags: dict, missing: list) -> list[str]:
    """A row per key of a section, its subsections' keys included (`reward.functions.<name>.fn`)."""
    rows = []
    for name, field in model.model_fields.items():
        sub, infix = _section_model(field.annotation)
        if sub is not None:
            rows += _rows(sub, f"{prefix}{name}.{infix}", flags, missing)
        else:
            rows.append(_row(prefix + name, field, flags, missing))
    return rows


def algorithm_table(name: str) -> str:
    """One algorithm's options (`trainer.algorithm_options`), its rollout, and the shared keys whose default it
    changes."""
    from omniroll.config.algorithms import ALGORITHMS

    spec = ALGORITHMS[name]
    lines = [f"`trainer.algorithm: {name}`: rollout `{spec.rollout}`"
             + (f" (`algo.sde_type`: {', '.join(f'`{t}`' for t in spec.sde_types)})" if spec.sde_types else "")
             + (f", `algo.same_latent: {str(spec.same_latent).lower()}`" if spec.same_latent is not None else "")
             + (", a tree rollout (`algo.tree`)" if spec.tree else "")
             + "."]
    if spec.defaults:
        lines.append("Its reference defaults of shared keys (used unless the key is set): "
                     + ", ".join(f"`trainer.{k}: {v!r}`" for k, v in spec.defaults.items()) + ".")
    fields = spec.options.model_fields
    if fields:
        lines += ["", "| `trainer.algorithm_options.*` | type | range | default | description |",
                  "|---|---|---|---|---|"]
        for key, field in fields.items():
            base, bounds, optional = _unwrap(field.annotation)
            lines.append(f"| `{key}` | {_cell(_type_name(base))} | {_range(bounds + list(field.metadata))} | "
                         f"{_cell(_default(field))} | {_cell(field.description or '')} |")
    else:
        lines.append("It has no options of its own: every setting is a shared `trainer.*` key.")
    return "\n".join(lines) + "\n"


def config_reference() -> str:
    from omniroll.cli.common import FLAGS
    from omniroll.config import OmniRollConfig
    from omniroll.config.algorithms import ALGORITHMS

    flags = {f.key: f.flag for f in FLAGS}
    missing: list[str] = []
    out = ["# Configuration reference", "",
           "Generated from the config schema (`omniroll/config/`) by `make docs-generate`; a test fails when this page "
           "differs from the code. A YAML file (`--config`), `--override KEY=VALUE` and the flags of the last column "
           "all set these "
           "keys; a flag overrides `--config`, which overrides the defaults below. An unknown key or a value out of "
           "range is an error naming the dotted key, before anything starts.", ""]
    for name, field in OmniRollConfig.model_fields.items():
        sub, _ = _section_model(field.annotation)
        if sub is None:
            continue
        out += [f"## `{name}`", "", _cell(field.description or (sub.__doc__ or "").strip().split("\n\n")[0]), "",
                "| key | type | range | default | description | flag |", "|---|---|---|---|---|---|"]
        out += _rows(sub, name + ".", flags, missing)
        out.append("")
    top = {k: f for k, f in OmniRollConfig.model_fields.items() if _section_model(f.annotation)[0] is None}
    out += ["## Top-level keys", "", "| key | type | range | default | description | flag |",
            "|---|---|---|---|---|---|"]
    out += [_row(name, field, flags, missing) for name, field in top.items()]
    out += ["", "## `trainer.algorithm_options`: each algorithm's own options", ""]
    for name in ALGORITHMS:
        out += [f"### `{name}`", "", algorithm_table(name)]
    if missing:
        raise ValueError(f"config keys without a description (add Field(description=...)): {', '.join(missing)}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- the CLI reference
def _flag_rows(parser) -> list[str]:
    """A row per flag of one command: its names and value, what it does (with its default, as `--help` shows it)."""
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.nargs == 0:
            value = ""
        elif action.choices is not None:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
        else:
            metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
            value = " ".join(f"`{m}`" for m in (metavar if isinstance(metavar, tuple) else (metavar,)))
        what = formatter._expand_help(action) if action.help else ""
        required = "**required**; " if action.required and action.option_strings else ""
        rows.append(f"| {names} | {value} | {required}{_cell(what)} |")
    return rows


def cli_reference() -> str:
    from omniroll.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["# Command-line reference", "",
           "Generated from the parsers `omniroll` builds (`omniroll/cli/`) by `make docs-generate`; a test fails when "
           "this page differs from the code. `omniroll <command> --help` prints the same. Every command exits 2 on a "
           "user error (one line per problem naming the flag or key; an output directory that cannot be written is "
           "one, found before any work starts), 1 when some work failed after the rest was "
           "written, 130 on Ctrl-C; `--debug` shows tracebacks. A flag that names a config key overrides `--config`; "
           "[the configuration reference](config.md) has every key.", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`omniroll {name}`](#omniroll-{name}) | {_cell(sub.choices[name].description or '')} |"
            for name in COMMANDS]
    for name in COMMANDS:
        command = sub.choices[name]
        positionals = " ".join(a.dest.upper() for a in command._actions
                               if not a.option_strings and a.help != argparse.SUPPRESS)
        required = " ".join(f"{a.option_strings[0]} {a.metavar or a.dest.upper()}" for a in command._actions
                            if a.option_strings and a.required)
        usage = " ".join(x for x in (f"omniroll {name}", positionals, required, "[options]") if x)
        out += ["", f"## omniroll {name}", "", _cell(command.description or ""), "", f"`{usage}`", "",
                "| flag | value | what it sets |", "|---|---|---|"]
        out += _flag_rows(command)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------ the engine reference: SamplingParams, EngineConfig
def _docstring_fields(cls) -> dict[str, str]:
    """`name: text` entries of a class docstring (an entry's continuation lines are indented), by name."""
    entries: dict[str, str] = {}
    name = None
    for line in (cls.__doc__ or "").splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m.group(1)
            entries[name] = m.group(2)
        elif name and line.startswith("        "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


def engine_reference() -> str:
    import dataclasses

    from omniroll.cli.common import FLAGS
    from omniroll.config.sections import AlgoSection, EngineSection, PipelineSection
    from omniroll.engine.config import EngineConfig
    from omniroll.engine.params import SamplingParams

    flags = {f.key: f.flag for f in FLAGS}
    missing: list[str] = []
    out = ["# Sampling parameters and engine settings", "",
           "Generated from `omniroll/engine/params.py` and `omniroll/engine/config.py` by `make docs-generate`; a "
           "test fails when this page differs from the code.", "",
           "## `SamplingParams`: what one request asks for", "",
           _cell(" ".join(SamplingParams.__doc__.split("\n\n")[0].split())), "",
           "In the YAML config most fields are set for every training or rollout request by the `pipeline` and `algo` "
           "sections (the key column; their defaults are the config's, which can differ from the class's: "
           "`pipeline.height` is 512); the agent loop sets `latent_seed` per prompt group with `algo.same_latent` "
           "(or `algo.tree`, which sets each leaf's `noise_seeds` too), and `logprobs` and `output_type` per "
           "algorithm. In Python, `SamplingParams(...)` takes every field; an "
           "unknown field or a value out of range is a `ValidationError` naming it.", "",
           "| field | type | range | default | description | YAML key | flag |", "|---|---|---|---|---|---|---|"]
    for name, field in SamplingParams.model_fields.items():
        key = next((f"{section}.{name}" for section, model in (("pipeline", PipelineSection), ("algo", AlgoSection))
                    if name in model.model_fields), "")
        description = field.description or (PipelineSection.model_fields.get(name) or
                                             AlgoSection.model_fields.get(name) or field).description
        if not description:
            missing.append(f"SamplingParams.{name}")
        base, bounds, optional = _unwrap(field.annotation)
        kind = _type_name(base) + (" or `None`" if optional else "")
        flag = flags.get(key, "")
        out.append(f"| `{name}` | {_cell(kind)} | {_range(bounds + list(field.metadata))} | {_cell(_default(field))} "
                   f"| {_cell(description or '')} | {f'`{key}`' if key else ''} | {f'`{flag}`' if flag else ''} |")
    described = _docstring_fields(EngineConfig)
    own = [f"`engine.{f.name}`" for f in dataclasses.fields(EngineConfig) if f.name in EngineSection.model_fields]
    out += ["", "## `EngineConfig`: one engine's settings", "",
            "One engine (one rollout replica). `DiffusionEngine.from_pretrained(path, device, dtype, max_batch_size, "
            f"**kwargs)` takes every field; in the YAML config {', '.join(own[:-1])} and {own[-1]} set {len(own)} of "
            "them and `engine.kwargs` the others (an unknown key is an error naming the allowed ones).", "",
            "| field | default | YAML key | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineConfig):
        if f.name not in described:
            missing.append(f"EngineConfig.{f.name}")
        key = f"engine.{f.name}" if f.name in EngineSection.model_fields else f"engine.kwargs.{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else "required"
        out.append(f"| `{f.name}` | `{default!r}` | `{key}` | {_cell(described.get(f.name, ''))} |")
    if missing:
        raise ValueError(f"fields without a description: {', '.join(missing)} (SamplingParams: Field(description=...);"
                         f" EngineConfig: a `name: text` entry in its docstring)")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------- the file map of the design page
def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", paragraph)[0]


def file_map() -> str:
    """A table per package: every module of `omniroll/` and the first sentence of its docstring."""
    package_root = ROOT / "omniroll"
    modules = sorted(p for p in package_root.rglob("*.py")
                     if "checkpoint" not in p.relative_to(package_root).parts[:-1])
    groups: dict[str, list[Path]] = {}
    for path in modules:
        rel = path.relative_to(package_root)
        groups.setdefault(rel.parts[0] if len(rel.parts) > 1 else "", []).append(path)
    out, missing = [], []
    for group in sorted(groups, key=lambda g: (g != "", g)):
        out += ["", f"**`omniroll/{group + '/' if group else ''}`**" + (" (leaf modules and the package)" if not group
                                                                         else ""), "",
                "| file | what it holds |", "|---|---|"]
        for path in groups[group]:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if not doc:
                missing.append(str(path.relative_to(ROOT)))
            out.append(f"| `{path.relative_to(package_root)}` | {_cell(first_sentence(doc))} |")
    if missing:
        raise ValueError(f"modules without a docstring: {', '.join(missing)}")
    return "\n".join(out[1:]) + "\n"
