"""The documentation's drawn pictures, each a PNG made by matplotlib from what it shows (`docs/hooks/generated.py`
writes them).

- `layers_picture`: the package layers as `tests/test_layers.py` enforces them (its `LAYER` table), for the design page.
- `training_step_picture`: what runs where in one training step (trainer, agent loop, replicas, reward workers,
  weight sync) and the step's timeline, synchronous and asynchronous, for the concepts page.

Each picture carries, in a PNG text chunk (`omniroll-inputs`), a hash of what it was drawn from (the data it shows and
the code that draws it): the staleness check compares that hash, not the pixels, so another matplotlib or font gives
no false alarm.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the PNG text chunk holding the hash of a picture's inputs
HASH_KEY = "omniroll-inputs"


def _png(fig, inputs: str) -> bytes:
    import matplotlib.pyplot as plt

    out = io.BytesIO()
    fig.savefig(out, format="png", metadata={"Software": None, HASH_KEY: inputs_hash(inputs)})
    plt.close(fig)
    return out.getvalue()


def inputs_hash(inputs: str) -> str:
    return hashlib.sha256(inputs.encode()).hexdigest()[:20]


def png_inputs_hash(data: bytes) -> str | None:
    """The inputs hash a PNG written by `_png` carries (None: none)."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).text.get(HASH_KEY)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------ the picture of the layers
#: what each layer holds, for the picture (the layers themselves come from tests/test_layers.py)
LAYER_NOTES = {"sampling": "fp32 SDE / CPS / ODE steps, windows, seeds", "tasks": "the shapes world",
               "models": "one adapter per family", "weights": "buckets, transports, LoRA, sender / receiver",
               "engine": "the one denoise loop", "rollout": "Ray replicas, routing client",
               "reward": "workers, manager, scorers", "config": "the YAML schema",
               "agent_loop": "the specification's agent loop", "trajectory_file": "the batch on disk",
               "evaluation": "GenEval on the shapes world", "train": "the trainer, one file per algorithm",
               "integrations": "verl / VeRL-Omni", "cli": "one module per command", "http": "omniroll serve"}


def _layer_table() -> dict[str, int]:
    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text())
    return next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "LAYER" for t in n.targets))


def layers_inputs() -> str:
    layer = _layer_table()
    dirs = sorted(n for n in layer if (ROOT / "omniroll" / n).is_dir())
    return repr((sorted(layer.items()), sorted(LAYER_NOTES.items()), dirs, inspect.getsource(layers_picture)))


def layers_picture() -> bytes:
    """A PNG: one band per layer rank, lowest at the bottom, its packages named (imports point down)."""
    plt = _pyplot()
    layer = _layer_table()
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
    return _png(fig, layers_inputs())
