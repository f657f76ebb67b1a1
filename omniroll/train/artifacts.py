"""What a training run writes and reads: metrics.jsonl, the step line, reward_curve.png, validation grids,
and checkpoint lookup."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_step(m: dict, total: int) -> str:
    return (f"step {m['step']:>4}/{total}  reward {m['reward_mean']:+.4f} +- {m['reward_std']:.4f}  "
            f"ratio_dev {m['ratio_max_abs_dev']:.1e}  clip {m['clip_frac']:.2f}  kl {m['approx_kl']:.1e}  "
            f"loss {m['loss']:+.4f}  gnorm {m['grad_norm']:.3f}  v{m['weight_version']}  "
            f"rollout {m['rollout_s']:.1f}s  reward_wait {m['reward_wait_s']:.2f}s  train {m['train_s']:.1f}s  "
            f"sync {m['sync_s']:.2f}s  step {m['step_s']:.1f}s" + _async_part(m))


def _async_part(m: dict) -> str:
    """The asynchronous trainer's fields of the step line (absent from older metrics)."""
    if "staleness_max" not in m:
        return ""
    return (f"  stale {m['staleness_min']}-{m['staleness_max']} (K={m.get('max_staleness', 0)})  "
            f"dropped {m.get('stale_dropped', 0)}  replay_dev {m['behaviour_replay_max_abs_dev']:.1e}  "
            f"overlap {m['overlap_frac']:.2f}  {m['samples_per_s']:.1f} samples/s")


def mode_label(m: dict) -> str:
    """'synchronous', 'async K=1' or 'async K=1 + partial' from a step's metrics."""
    k = int(m.get("max_staleness", 0) or 0)
    if k == 0:
        return "synchronous"
    return f"async K={k}" + (" + partial" if m.get("partial_rollout") else "")


def find_checkpoint(path: str) -> str:
    """A checkpoint directory: `path` itself (it holds trainer_state.pt) or a run directory's latest checkpoint."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    latest = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = os.path.join(path, "checkpoints", f.read().strip())
        if os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):
            return ckpt
    raise FileNotFoundError(f"--resume {path}: neither a checkpoint (trainer_state.pt) nor a run directory with "
                            f"checkpoints/latest")


TRAINER_STATE_KEYS = ("step", "version", "optimizer", "mode")


def read_trainer_state(ckpt: str) -> dict:
    """A checkpoint's trainer_state.pt, loaded with `weights_only=True`: tensors and plain containers only, so a
    resume directory cannot run code (a pickle that would is refused). ValueError naming the file otherwise."""
    import pickle

    path = os.path.join(ckpt, "trainer_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"--resume {path}: refused: not loadable as plain tensors and containers (weights_only), "
                         f"so it was not unpickled; it is not an omniroll checkpoint, or one from an older "
                         f"version: start a fresh run ({first})") from None
    missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"--resume {path}: not an omniroll trainer state (missing {missing}): start a fresh run")
    return state


def save_val_grid(images: torch.Tensor, rows: int, cols: int, path: str, scale: int = 2) -> None:
    """uint8 [rows * cols, 3, H, W] -> one PNG, a row per prompt (nearest-neighbour upscaled by `scale`)."""
    from PIL import Image

    n, _, H, W = images.shape
    grid = images.reshape(rows, cols, 3, H, W).permute(0, 3, 1, 4, 2).reshape(rows * H, cols * W, 3)
    img = Image.fromarray(grid.numpy())
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    img.save(path)


def plot_rewards(history: list[dict], path: str, val: Optional[list[dict]] = None) -> None:
    """reward_curve.png: mean training reward per step with a +-1 std band (and validation points if any)."""
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    mean = [m["reward_mean"] for m in history]
    std = [m["reward_std"] for m in history]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.fill_between(steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.2,
                    label="+-1 std (samples)")
    ax.plot(steps, mean, marker="o", ms=3, label="mean reward (training rollouts)")
    val = val if val is not None else read_jsonl(os.path.join(os.path.dirname(path), "validation.jsonl"))
    pts = [(v["step"], v["val_reward_mean"]) for v in val if v.get("val_reward_mean") is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", ms=5, label="validation (ODE, fixed seeds)")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    mode = mode_label(history[-1])
    if mode != "synchronous":
        mode += f", staleness max {max(m.get('staleness_max', 0) for m in history)}"
    ax.set_title(f"Flow-GRPO on the tiny SD3 (omniroll train, {mode})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_reward_curves(runs: dict[str, list[dict]], path: str, title: str = "") -> None:
    """Several runs' mean training reward per step on one plot (label -> metrics), e.g. synchronous vs async."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for label, history in runs.items():
        stale = max((m.get("staleness_max", 0) for m in history), default=0)
        ax.plot([m["step"] for m in history], [m["reward_mean"] for m in history], marker="o", ms=2.5,
                label=f"{label} (max staleness seen {stale})")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward (training rollouts)")
    ax.set_title(title or "Flow-GRPO: synchronous vs asynchronous")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)

