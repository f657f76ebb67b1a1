"""The docs site's generated pages, built from the code at every `mkdocs build` so that they cannot drift from it.

- `reference/config.md`: every key of the YAML config (`omniroll.config.OmniRollConfig`): type, allowed values,
  default, description and the command-line flag that sets it (`omniroll.cli.common.FLAGS`), plus each training
  algorithm's own options (`omniroll.config.algorithms.ALGORITHMS`). A key without a description fails the build.
- `reference/cli.md`: every command's `--help`, from the parsers `omniroll` itself builds.
- `changelog.md` and `contributing.md`: the repository's CHANGELOG.md and CONTRIBUTING.md (one copy of each).
- `design_layers.png`: the package layers as `tests/test_layers.py` enforces them (its `LAYER` table).
- In any page, the line `<!-- generated: algorithm nft -->` is replaced by that algorithm's options table.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from mkdocs.structure.files import File
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
ALGORITHM_MARKER = re.compile(r"^<!-- generated: algorithm (\w+) -->$", re.M)


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
        args = ", ".join(_type_name(_unwrap(a)[0]) for a in typing.get_args(annotation))
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
    return text.replace("|", "\\|").replace("\n", " ")


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
           "Generated from the config schema (`omniroll/config/`) at every docs build: it cannot drift from the "
           "code. A YAML file (`--config`), `--override KEY=VALUE` and the flags of the last column all set these "
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
def cli_reference() -> str:
    from omniroll.cli import COMMANDS, build_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps help text to the terminal's width: a fixed width, one page
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["# Command-line reference", "",
           "Generated from the parsers `omniroll` builds (`omniroll/cli/`), at every docs build. Every command "
           "exits 2 on a user error (one line per problem naming the flag or key), 1 when some work failed after the "
           "rest was written, 130 on Ctrl-C; `--debug` shows tracebacks.", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`omniroll {name}`](#omniroll-{name}) | {_cell(sub.choices[name].description or '')} |"
            for name in COMMANDS]
    for name in COMMANDS:
        out += ["", f"## omniroll {name}", "", "```text", sub.choices[name].format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ the picture of the layers
#: what each layer holds, for the picture (the layers themselves come from tests/test_layers.py)
LAYER_NOTES = {"sampling": "fp32 SDE / CPS / ODE steps, windows, seeds", "tasks": "the shapes world",
               "models": "one adapter per family", "weights": "buckets, transports, LoRA, sender / receiver",
               "engine": "the one denoise loop", "rollout": "Ray replicas, routing client",
               "reward": "workers, manager, scorers", "config": "the YAML schema",
               "agent_loop": "the specification's agent loop", "trajectory_file": "the batch on disk",
               "evaluation": "GenEval on the shapes world", "run_rollout": "a rollout batch from Python",
               "train": "the trainer, one file per algorithm",
               "integrations": "verl / VeRL-Omni", "cli": "one module per command", "http": "omniroll serve"}


def layers_picture() -> bytes:
    """A PNG: one band per layer rank, lowest at the bottom, its packages named (imports point down)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text())
    layer = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "LAYER" for t in n.targets))
    ranks = sorted(set(layer.values()))
    fig, ax = plt.subplots(figsize=(9, 0.62 * len(ranks) + 0.6), dpi=110)
    for i, rank in enumerate(ranks):
        names = sorted(n for n, r in layer.items() if r == rank and n != "trajectory")
        leaf = rank == 0
        ax.add_patch(plt.Rectangle((0, i), 10, 0.82, color="#e8eaf6" if not leaf else "#eeeeee", ec="#3f51b5"))
        label = "leaf modules: " + ", ".join(names) if leaf else "  |  ".join(
            f"{n}{'/' if (ROOT / 'omniroll' / n).is_dir() else '.py'}: {LAYER_NOTES.get(n, '')}" for n in names)
        ax.text(0.15, i + 0.41, label, va="center", fontsize=9)
    ax.annotate("", xy=(10.35, 0.2), xytext=(10.35, len(ranks) - 0.2),
                arrowprops={"arrowstyle": "->", "color": "#3f51b5"})
    ax.text(10.5, len(ranks) / 2, "imports point down", rotation=90, va="center", fontsize=9, color="#3f51b5")
    ax.set_xlim(0, 11)
    ax.set_ylim(-0.1, len(ranks))
    ax.axis("off")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


# ------------------------------------------------------------------------------------------------- mkdocs hooks
def on_files(files, config):
    """Add the generated pages (replacing any file of the same name)."""
    pages = {"reference/config.md": config_reference(), "reference/cli.md": cli_reference(),
             # the repository's own files, their links to docs/ pages made relative to the site
             "changelog.md": (ROOT / "CHANGELOG.md").read_text().replace("](docs/", "]("),
             "contributing.md": (ROOT / "CONTRIBUTING.md").read_text().replace("](docs/", "](")}
    pages["design_layers.png"] = layers_picture()
    for path, content in pages.items():
        old = files.get_file_from_path(path)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    return ALGORITHM_MARKER.sub(lambda m: algorithm_table(m.group(1)), markdown)
