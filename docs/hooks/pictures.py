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
               "evaluation": "GenEval on the shapes world", "run_rollout": "a rollout batch from Python",
               "train": "the trainer, one file per algorithm",
               "export": "a checkpoint as files diffusers loads",
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


# ------------------------------------------------------------------------- the runtime picture of one training step
def training_step_inputs() -> str:
    return inspect.getsource(training_step_picture) + inspect.getsource(_box) + inspect.getsource(_arrow)


def _box(ax, x, y, w, h, title, lines, face):
    import matplotlib.patches as patches

    ax.add_patch(patches.FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=face,
                                        ec="#37474f", lw=1.2))
    ax.text(x + w / 2, y + h - 0.17, title, ha="center", va="top", fontsize=9.5, weight="bold")
    ax.text(x + w / 2, y + h - 0.47, "\n".join(lines), ha="center", va="top", fontsize=7.8, linespacing=1.35)


def _arrow(ax, start, end, label, *, color="#37474f", offset=(0.0, 0.1), style="-|>", ls="-", rad=0.0, ha="center"):
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": style, "color": color, "lw": 1.4, "ls": ls,
                                                      "connectionstyle": f"arc3,rad={rad}", "shrinkA": 2,
                                                      "shrinkB": 2})
    mid = ((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1])
    ax.text(*mid, label, ha=ha, va="center", fontsize=7.6, color=color,
            bbox={"fc": "white", "ec": "none", "pad": 0.6, "alpha": 0.9})


def training_step_picture() -> bytes:
    """A PNG: the processes of one training step and what flows between them (top); what each is busy with, step by
    step, in the synchronous trainer and the asynchronous one (`max_staleness: 1`) (bottom)."""
    plt = _pyplot()
    fig = plt.figure(figsize=(11, 9.4), dpi=110)
    top = fig.add_axes((0.01, 0.455, 0.98, 0.54))
    top.set_xlim(0, 11)
    top.set_ylim(0, 5.6)
    top.axis("off")
    top.text(0.05, 5.45, "One training step: who runs where (each box is a process; Ray actors can sit on any node)",
             fontsize=10.5, weight="bold", va="top")
    _box(top, 0.2, 0.2, 2.9, 4.75, "trainer (the driver)",
         ["Trainer: omniroll train", "", "1. asks for prompts x n samples", "4. advantages per prompt group",
          "5. the algorithm's update: the", "    recorded steps recomputed with", "    the rollout's own function",
          "    (ratio exactly 1 before it)", "6. pushes the weights, version t", "", "metrics.jsonl, trackers,",
          "checkpoints, evaluations", "", "trainer.world_size > 1: the update", "on N Ray actors, gradients",
          "all-reduced"], "#e3f2fd")
    _box(top, 4.0, 3.35, 2.9, 1.6, "agent-loop workers",
         ["AgentLoopManager splits the batch;", "each row: seed, uid, request;", "returns a DataBatch:",
          "trajectories, rewards, versions"],
         "#fff8e1")
    _box(top, 7.8, 0.2, 3.0, 4.75, "rollout replicas",
         ["one DiffusionEngine each:", "one denoise loop, step-level", "batching across requests;",
          "records latents, sigmas and", "fp32 SDE log-probs", "", "a weight update is a transaction",
          "between two denoising steps:", "checked, then committed;", "every sample records the version",
          "of each of its steps"], "#e8f5e9")
    _box(top, 4.0, 1.0, 2.9, 1.45, "reward workers",
         ["RewardManager: reward.functions,", "combined; micro-batches;", "an error is never a reward of 0"],
         "#fce4ec")
    _arrow(top, (3.1, 4.5), (4.0, 4.5), "prompts")
    _arrow(top, (6.9, 4.55), (7.8, 4.55), "2. requests")
    _arrow(top, (7.8, 3.75), (6.9, 3.75), "samples, as\neach finishes", offset=(0.0, -0.32))
    _arrow(top, (5.15, 3.35), (5.15, 2.45), "3. streamed:\nscored while\nothers generate", offset=(-0.6, 0.0))
    _arrow(top, (5.75, 2.45), (5.75, 3.35), "rewards", offset=(0.42, 0.0))
    _arrow(top, (4.0, 3.75), (3.1, 3.75), "DataBatch", offset=(0.0, -0.2))
    _arrow(top, (3.1, 0.55), (7.8, 0.55), "6. weights, version t: in-process, /dev/shm (same node)\n"
           "or the Ray object store; every replica acknowledges", color="#5e35b1", offset=(0.0, 0.0))

    bottom = fig.add_axes((0.12, 0.04, 0.86, 0.345))
    lanes = [("synchronous", "trainer"), ("synchronous", "replicas"), ("asynchronous", "trainer"),
             ("asynchronous", "replicas")]
    colors = {"rollout": "#a5d6a7", "train": "#90caf9", "sync": "#b39ddb", "wait": "#eeeeee"}
    hatches = {"rollout": "", "train": "//", "sync": "xx", "wait": ".."}
    R, T, S = 1.0, 0.7, 0.12  # rollout, train, sync durations (illustrative)
    bars = {lane: [] for lane in range(4)}
    t = 0.0
    for step in (1, 2, 3):  # synchronous: rollout, then train, then sync; nothing overlaps
        bars[1].append((t, R, "rollout", f"batch {step}, v{step - 1}"))
        bars[0].append((t, R, "wait", ""))
        bars[0].append((t + R, T, "train", f"train {step}"))
        bars[1].append((t + R, T, "wait", ""))
        bars[1].append((t + R + T, S, "sync", ""))
        bars[0].append((t + R + T, S, "sync", ""))
        t += R + T + S
    sync_end = t
    # asynchronous (K = 1, partial_rollout false): batch t + 1 generates while step t trains; a sync waits for it
    bars[3].append((0.0, R, "rollout", "batch 1, v0"))
    bars[2].append((0.0, R, "wait", ""))
    bars[3].append((R, R, "rollout", "batch 2, v0"))
    t = R
    for step in (1, 2, 3, 4):
        bars[2].append((t, T, "train", f"train {step}"))
        if step < 4:
            bars[2].append((t + T, R - T, "wait", ""))  # the sync waits for the batch in flight (partial: false)
            bars[2].append((t + R, S, "sync", ""))
            bars[3].append((t + R, S, "sync", ""))
            bars[3].append((t + R + S, R, "rollout", f"batch {step + 2}, v{step}"))
        t += R + S
    for lane, items in bars.items():
        y = 3 - lane + (0.25 if lane < 2 else -0.25)
        for x0, w, kind, label in items:
            if x0 >= sync_end + 0.01:
                continue
            w = min(w, sync_end - x0)
            bottom.barh(y, w, left=x0, height=0.62, color=colors[kind], hatch=hatches[kind], edgecolor="#546e7a",
                        lw=0.6)
            if label:
                bottom.text(x0 + w / 2, y, label, ha="center", va="center", fontsize=7.4)
    bottom.set_yticks([3.25, 2.25, 0.75, -0.25])
    bottom.set_yticklabels([f"{a}\n{b}" for a, b in lanes], fontsize=8)
    bottom.set_xlim(0, sync_end)
    bottom.set_xlabel("time (illustrative: in a real step the proportions vary)", fontsize=8)
    bottom.set_xticks([])
    for name in ("top", "right"):
        bottom.spines[name].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=colors[k], hatch=hatches[k], ec="#546e7a") for k in colors]
    bottom.legend(handles, ["rollout (rewards stream meanwhile)", "update", "weight sync", "idle"], ncol=4,
                  fontsize=7.8, loc="upper center", bbox_to_anchor=(0.5, 1.13), frameon=False)
    bottom.text(sync_end, 1.5, "asynchronous (trainer.max_staleness: 1): batch t+1 generates while step t trains, one "
                "version old;\nthe trainer corrects for it per window step (decoupled PPO); a sync waits for the "
                "batch in flight", ha="right", va="center", fontsize=7.6, style="italic")
    return _png(fig, training_step_inputs())
