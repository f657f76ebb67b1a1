"""The reward curves a run draws: `reward_curve.png` (one run's mean training reward per step, its spread and the
validation points; titled with the model and the trainer's mode) and several runs on one plot (the benchmarks'
synchronous vs asynchronous comparison)."""

from __future__ import annotations

import os
from typing import Optional

from omniroll.train.report.tracking import mode_label, read_jsonl
from omniroll.train.report.task_eval import guidance_label


def plot_rewards(history: list[dict], path: str, val: Optional[list[dict]] = None, model: str = "the model",
                 algorithm: str = "RL") -> None:
    """reward_curve.png: mean training reward per step with a +-1 std band (and validation points if any); the
    title names the algorithm (its `title`), `model` (`model_name(config)`) and the mode."""
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
        cfg = {guidance_label(v["cfg_scale"]) for v in val if v.get("val_reward_mean") is not None
               and v.get("cfg_scale") is not None}  # records from before 0.3.6 have none
        regime = f", {cfg.pop()}" if len(cfg) == 1 else ""  # the regime it trains (train/report/validation.py)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", ms=5, label=f"validation (ODE, fixed seeds{regime})")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_title(curve_title(history, model, algorithm))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def curve_title(history: list[dict], model: str, algorithm: str) -> str:
    """reward_curve.png's title: the algorithm, the model and the mode, e.g. 'Flow-GRPO on tiny (omniroll train,
    synchronous)'."""
    mode = mode_label(history[-1])
    if mode != "synchronous":
        mode += f", staleness max {max(m.get('staleness_max', 0) for m in history)}"
    return f"{algorithm} on {model} (omniroll train, {mode})"


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
