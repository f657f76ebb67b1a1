"""What a training run writes and reads: experiment tracking for `omniroll train` (verl's `trainer.logger` list over
console, jsonl, tensorboard, wandb, swanlab and mlflow), and its files: metrics.jsonl and the step line (below
`Tracker`); checkpoints are `train/checkpoint.py`'s. reward_curve.png is drawn by `reward_curve.py`, the validation
grids by `val_grid.py`.

    trainer:
      logger: [console, jsonl, tensorboard, wandb]   # any subset; default [console, jsonl]
      project_name: omniroll
      experiment_name: null                          # default: {model}-{mode}-{YYYYmmdd-HHMMSS}
      log_images_every: 10                           # training samples as captioned images (0: never)
      log_images_count: 4

What each step logs: every metric of the step line under a tracker name (`tracker_name`: `reward/mean`,
`actor/clipfrac`, `actor/ratio_mean_ts_3`, `timing/rollout_s`, ...; a key this table does not know keeps a prefix
by its shape, never dropped), `reward/zero_std_ratio`, `reward/<fn>/mean` (each reward function's own score, whatever
its weight) and `reward/<fn>/<key>` (each numeric extra a scorer returned; both also in metrics.jsonl,
`reward_breakdown.py`), and the histogram `reward/hist` of the step's sample rewards. Every `log_images_every` steps a
few training samples (`train/samples`, one per prompt group, captioned `prompt | reward`); at every validation the
samples (`val/samples`), the grid (`val/grid`), `val/reward_mean` and `val/reward/<fn>/...`, and with
`reward.held_out` the held-out functions' `val/held_out/<fn>/score`, `.../z`, `.../falling` (`held_out.py`; also in
metrics.jsonl). Videos go as video where the backend has it.

Console is the step line; jsonl is `metrics.jsonl` in the output directory. The other backends are optional extras
(`pip install 'omniroll[tensorboard]'`, ...), imported only when named; `check_loggers` names a missing one with
its pip command before anything starts. `Tracker.state()` (the backends' run ids) is kept in the checkpoint, so a
resumed run continues the same tracker runs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from typing import Any, Callable, Optional

import numpy as np

from omniroll.train.ratio_steps import split_step_key, step_key
from omniroll.train.report.reward_breakdown import reward_breakdown


#: the backends are listed once, as `omniroll.config.LOGGERS` (config/trainer.py); these four are optional extras:
#: backend -> (module that must import, what to pip install)
_REQUIRES = {"tensorboard": ("tensorboard", "pip install 'omniroll[tensorboard]'  (or: pip install tensorboard)"),
             "wandb": ("wandb", "pip install 'omniroll[wandb]'  (or: pip install wandb)"),
             "swanlab": ("swanlab", "pip install 'omniroll[swanlab]'  (or: pip install swanlab)"),
             "mlflow": ("mlflow", "pip install 'omniroll[mlflow]'  (or: pip install mlflow-skinny)")}

_HINTS = {"wandb": " (no network or login: WANDB_MODE=offline)", "swanlab": " (no network: SWANLAB_MODE=offline)",
          "mlflow": " (MLFLOW_TRACKING_URI; unset: a file store in the output directory)"}

#: step-line keys -> tracker names (close to flow_grpo's and VeRL-Omni's)
NAMES = {
    "reward_mean": "reward/mean", "reward_std": "reward/std", "tied_groups": "reward/zero_std_groups",
    "num_groups": "batch/num_groups", "num_samples": "batch/num_samples",
    "ratio_max_abs_dev": "actor/ratio_max_abs_dev", "clip_frac": "actor/clipfrac", "approx_kl": "actor/approx_kl",
    "loss": "actor/loss", "policy_loss": "actor/pg_loss", "kl": "actor/kl_loss", "grad_norm": "actor/grad_norm",
    "optimizer_steps": "actor/optimizer_steps", "policy_kl": "actor/policy_kl",
    "post_approx_kl": "actor/post_approx_kl", "post_clip_frac": "actor/post_clipfrac",
    "weight_version": "rollout/weight_version",
    "synced_version": "rollout/synced_version",
    "grad_cos": "actor/grad_cos", "grad_cos_rows": "actor/grad_cos_rows", "grad_snr": "actor/grad_snr",
    "grad_samples_for_cos50": "actor/grad_samples_for_cos50",
    # the ratio statistics (train/ratio_steps.py), VeRL-Omni's names; per denoising step index with `_ts_<t>` after
    "ratio_mean": "actor/ratio_mean", "ratio_std": "actor/ratio_std", "clip_frac_higher": "actor/pg_clipfrac_higher",
    "clip_frac_lower": "actor/pg_clipfrac_lower", "log_prob_abs_diff": "actor/logprob_abs_diff",
    "ratio_samples": "actor/ratio_samples",
}
#: a key these do not name gets a prefix by its shape (see `tracker_name`)
_ASYNC_PREFIXES = ("staleness", "off_policy", "stale", "async", "partial", "min_weight_version",
                   "max_weight_version", "dropped")


def check_loggers(names: list[str]) -> None:
    """ValueError naming `trainer.logger` and the pip command for each named backend that does not import."""
    problems = [f"trainer.logger: {name!r} is not installed: {_REQUIRES[name][1]}" for name in names
                if name in _REQUIRES and importlib.util.find_spec(_REQUIRES[name][0]) is None]
    if problems:
        raise ValueError("\n".join(problems))


def tracker_name(key: str) -> str:
    """The tracker name of a step-line key: the table above (a per-timestep ratio statistic `<name>_ts_<t>` as its
    name's, with `_ts_<t>` after); else kept if it already has a '/'; `*_s` under timing/; `peak_mem_*` under perf/;
    staleness / off-policy / async keys under async/; `val_*` under val/; anything else under train/."""
    if key in NAMES:
        return NAMES[key]
    per_step = split_step_key(key)
    if per_step is not None:
        return step_key(NAMES[per_step[0]], per_step[1])
    if "/" in key:
        return key
    if key.endswith("_s"):
        return f"timing/{key}"
    if key.startswith("peak_mem_"):  # peak device memory per stage (train/report/stage_memory.py)
        return f"perf/{key}"
    if key.startswith(_ASYNC_PREFIXES):
        return f"async/{key}"
    if key.startswith("val_"):
        return f"val/{key[4:]}"
    return f"train/{key}"


def scalars(record: dict) -> dict[str, float]:
    """Every number of a step record under its tracker name (bools as 0/1; nested dicts flattened with '/';
    strings, lists and None are not scalars), plus the ratios derived from them."""
    out: dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{name}/{k}", v)
        elif isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
            out[name] = float(value)

    for key, value in record.items():
        if key != "step":
            add(tracker_name(key), value)
    if record.get("num_groups"):
        out["reward/zero_std_ratio"] = record.get("tied_groups", 0) / record["num_groups"]
    if record.get("num_samples") and record.get("step_s"):
        out["perf/samples_per_s"] = record["num_samples"] / record["step_s"]
    return out


def model_name(config: Any) -> str:
    """The run's model as a person names it: `engine.model`, the last part of it for a path."""
    return os.path.basename(os.path.normpath(str(config.engine.model))) or "model"


def default_experiment_name(config: Any) -> str:
    return f"{model_name(config)}-{config.trainer.mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def samples_of(batch: Any, count: int, one_per_group: bool = True) -> list[tuple[np.ndarray, str]]:
    """Up to `count` (pixels, caption) pairs of a batch: uint8 HWC images or THWC videos, `prompt | reward`."""
    if count <= 0 or "responses" not in batch.batch.keys():
        return []
    pixels = batch.batch["responses"]
    prompts = list(batch.non_tensor_batch.get("raw_prompt", [""] * len(pixels)))
    uids = list(batch.non_tensor_batch.get("uid", range(len(pixels))))
    scores = batch.batch["rm_scores"][:, 0].tolist() if "rm_scores" in batch.batch.keys() else None
    rows, seen = [], set()
    for i, uid in enumerate(uids):
        if (uid not in seen or not one_per_group) and len(rows) < count:
            rows.append(i)
            seen.add(uid)
    out = []
    for i in rows:
        px = pixels[i]
        arr = (px.permute(1, 2, 0) if px.dim() == 3 else px.permute(0, 2, 3, 1)).contiguous().numpy()
        caption = str(prompts[i]) + (f" | {scores[i]:.4f}" if scores is not None else "")
        out.append((arr.astype(np.uint8), caption))
    return out


class Tracker:
    """The loggers of one run. `log_step` / `log_validation` from the trainer; `state()` into the checkpoint."""

    def __init__(self, config: Any, out_dir: str, resume_state: Optional[dict] = None,
                 log: Callable[[str], None] = print):
        tc = config.trainer
        check_loggers(list(tc.logger))
        state = dict(resume_state or {})
        self.names = list(tc.logger)
        self.total_steps = tc.steps
        self.images_every, self.images_count = tc.log_images_every, tc.log_images_count
        self.fps = config.pipeline.fps
        self.out_dir = out_dir
        self.log = log
        self.project = tc.project_name
        self.experiment = tc.experiment_name or state.get("experiment_name") or default_experiment_name(config)
        self.backends: dict[str, Any] = {}
        if any(n in _REQUIRES for n in self.names):
            from omniroll.train.report import tracking_backends as tb

            info = tb.RunInfo(project=self.project, experiment=self.experiment, out_dir=out_dir,
                              config=config.model_dump(mode="json"), resume_step=int(state.get("step", 0)))
            for name in self.names:
                if name in _REQUIRES:
                    try:
                        self.backends[name] = tb.BACKENDS[name](info, state.get(f"{name}_run_id"))
                    except Exception as e:  # noqa: BLE001 - e.g. wandb online without a login: one line, named
                        self.close()
                        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                        raise ValueError(f"trainer.logger: {name} could not start its run: {type(e).__name__}: "
                                         f"{first}{_HINTS.get(name, '')}") from e

    # ------------------------------------------------------------------ what the trainer calls
    def log_step(self, m: dict, batch: Any = None, total: Optional[int] = None) -> None:
        """One training step: the step line (console; `total`: the step the run goes to, default `trainer.steps`),
        metrics.jsonl, and every backend's scalars, reward histogram and, every `log_images_every` steps, a few
        captioned training samples."""
        step = int(m["step"])
        extra = {f"reward/{k}": v for k, v in reward_breakdown(batch).items()}
        if "console" in self.names:
            self.log(format_step(m, total or self.total_steps))
        if "jsonl" in self.names:
            append_jsonl(os.path.join(self.out_dir, "metrics.jsonl"), {**m, **extra})
        if not self.backends:
            return
        values = {**scalars(m), **extra}
        rewards = (batch.batch["rm_scores"][:, 0].float().numpy()
                   if batch is not None and "rm_scores" in batch.batch.keys() else None)
        media = (samples_of(batch, self.images_count)
                 if batch is not None and self.images_every and step % self.images_every == 0 else [])
        for b in self.backends.values():
            b.log_scalars(values, step)
            if rewards is not None and len(rewards):
                b.log_histogram("reward/hist", rewards, step)
            if media:
                b.log_media("train/samples", media, step, self.fps)

    def log_validation(self, tag: str, step: int, batch: Any, score: Optional[float], grid_path: Optional[str],
                       max_images: int = 16) -> None:
        """A validation: `val/reward_mean`, `val/reward/<fn>/mean` and `val/reward/<fn>/<key>` (each reward
        function's own mean, each numeric scorer extra), the samples captioned `prompt | reward` and the grid image."""
        if not self.backends:
            return
        parts = {f"val/reward/{k}": v for k, v in reward_breakdown(batch).items()}
        media = samples_of(batch, max_images, one_per_group=False)
        grid = None
        if grid_path and os.path.isfile(grid_path):
            from PIL import Image

            grid = [(np.asarray(Image.open(grid_path).convert("RGB")), f"validation {tag} (step {step})")]
        for b in self.backends.values():
            if score is not None and math.isfinite(score):
                b.log_scalars({"val/reward_mean": float(score)}, step)
            if parts:
                b.log_scalars(parts, step)
            if media:
                b.log_media("val/samples", media, step, self.fps)
            if grid:
                b.log_media("val/grid", grid, step, self.fps)

    def log_eval(self, tag: str, step: int, metrics: dict[str, float], lines: list[str]) -> None:
        """A task evaluation (`omniroll.train.report.task_eval`): its summary lines (console), one metrics.jsonl record
        `{"step", "eval": tag, "eval/<split>/...": ...}` (training steps' records hold `reward_mean`; these do not)
        and the scalars to every backend."""
        if "console" in self.names:
            for line in lines:
                self.log(line)
        if "jsonl" in self.names:
            append_jsonl(os.path.join(self.out_dir, "metrics.jsonl"), {"step": step, "eval": tag, **metrics})
        for b in self.backends.values():
            b.log_scalars(dict(metrics), step)

    def log_held_out(self, tag: str, step: int, metrics: dict[str, float]) -> None:
        """A validation's held-out rewards (`omniroll.train.report.held_out`): one metrics.jsonl record
        `{"step", "validation": tag, "val/held_out/...": ...}` (no `reward_mean`: not a training step) and the scalars
        to every backend."""
        if "jsonl" in self.names:
            append_jsonl(os.path.join(self.out_dir, "metrics.jsonl"), {"step": step, "validation": tag, **metrics})
        for b in self.backends.values():
            b.log_scalars(dict(metrics), step)

    def state(self, step: int) -> dict:
        """What a checkpoint keeps so that a resumed run continues the same tracker runs."""
        out: dict[str, Any] = {"project_name": self.project, "experiment_name": self.experiment, "step": step}
        for name, b in self.backends.items():
            out[f"{name}_run_id"] = b.run_id
        return out

    def close(self) -> None:
        for name, b in list(self.backends.items()):
            try:
                b.close()
            except Exception as e:  # noqa: BLE001 - a tracker that fails to flush must not hide the run's result
                self.log(f"trainer.logger: {name} did not close cleanly: {type(e).__name__}: {e}")
        self.backends = {}


# ------------------------------------------------------------------------------------------------ the run's files
def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def step_records(out_dir: str) -> list[dict]:
    """The training steps' records of a run's metrics.jsonl (its task evaluations' records, which carry no
    `reward_mean`, left out)."""
    return [m for m in read_jsonl(os.path.join(out_dir, "metrics.jsonl")) if "reward_mean" in m]


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_step(m: dict, total: int) -> str:
    return (f"step {m['step']:>4}/{total}  reward {m['reward_mean']:+.4f} +- {m['reward_std']:.4f}  "
            f"ratio_dev {m['ratio_max_abs_dev']:.1e}  clip {m['clip_frac']:.2f}  "
            f"akl {m['approx_kl']:.1e}  kl {m['kl']:.1e}  loss {m['loss']:+.4f}  gnorm {m['grad_norm']:.3f}  "
            f"{_signal_part(m)}{_move_part(m)}v{m['weight_version']}  "
            f"rollout {m['rollout_s']:.1f}s  reward_wait {m['reward_wait_s']:.2f}s  train {m['train_s']:.1f}s  "
            f"sync {m['sync_s']:.2f}s  {_device_part(m)}step {m['step_s']:.1f}s" + _async_part(m)
            + (f"  WARNING {m['held_out_warning']}" if m.get("held_out_warning") else ""))


def _device_part(m: dict) -> str:
    """Colocated replicas' sleep and wake, and the peak memory per stage (absent when not colocated / not reported)."""
    out = f"sleep {m['sleep_s']:.2f}s  wake {m['wake_s']:.2f}s  " if "sleep_s" in m else ""
    peaks = [(s, m[f"peak_mem_{s}_gb"]) for s in ("rollout", "recompute", "update", "sync") if f"peak_mem_{s}_gb" in m]
    if peaks:
        out += "mem " + " ".join(f"{s} {gb:.1f}" for s, gb in peaks) + " GiB  "
    return out


def _signal_part(m: dict) -> str:
    """The gradient-signal meter's reading (grad_signal.py; absent on steps it did not read)."""
    if m.get("grad_cos") is None:
        return ""
    return f"grad_cos {m['grad_cos']:+.3f}  "


def _move_part(m: dict) -> str:
    """How far the update moved the policy (policy_move.py; absent when not measured)."""
    if "policy_kl" not in m:
        return ""
    return (f"policy_kl {m['policy_kl']:.1e}  post_akl {m['post_approx_kl']:.1e}  "
            f"post_clip {m['post_clip_frac']:.2f}  ")


def _async_part(m: dict) -> str:
    """The asynchronous trainer's fields of the step line (absent from older metrics)."""
    if "staleness_max" not in m:
        return ""
    replay = (f"replay_dev {m['behaviour_replay_max_abs_dev']:.1e}  " if "behaviour_replay_max_abs_dev" in m
              else "")  # log-prob algorithms only
    return (f"  stale {m['staleness_min']}-{m['staleness_max']} (K={m.get('max_staleness', 0)})  "
            f"dropped {m.get('stale_dropped', 0)}  {replay}"
            f"overlap {m['overlap_frac']:.2f}  {m['samples_per_s']:.1f} samples/s")


def mode_label(m: dict) -> str:
    """'synchronous', 'async K=1' or 'async K=1 + partial' from a step's metrics."""
    k = int(m.get("max_staleness", 0) or 0)
    if k == 0:
        return "synchronous"
    return f"async K={k}" + (" + partial" if m.get("partial_rollout") else "")
