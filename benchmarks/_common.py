"""Helpers shared by the benchmark scripts (one copy of each).

The scripts run as `python benchmarks/X.py`, so this directory is on sys.path and they import it as `_common`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import platform
import statistics
import time

import torch

COLORS = "red blue green yellow orange purple pink brown black white gray golden".split()
SUBJECTS = "cat dog bird fish horse cow sheep rabbit lion tiger bear elephant fox owl robot astronaut".split()
PLACES = ("on a table", "in a forest", "on the beach", "in the city", "under the moon", "near a river",
          "in a garden", "on a mountain", "in a kitchen", "in the snow")


# ------------------------------------------------------------------------------------------- training steps
#: the prompts of the training-step benchmarks (blue / green: the colours the tiny random VAE can make)
TRAIN_PROMPTS = ["a blue car", "a green car", "a blue bird", "a green bird", "a blue house", "a green house"]


def train_step_config(args, model: str, reward_functions: dict, **trainer):
    """The training-step benchmarks' config (train_step.py, train_scaling.py): the tiny model, one replica, one
    agent-loop and one reward worker, an SDE window of 3 in steps [0, 6); `args` gives prompts, n, size, steps and
    threads; `trainer` adds or overrides trainer keys."""
    from omniroll.config import load_config

    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 64, "num_threads": args.threads},
        "pipeline": {"height": args.size, "width": args.size, "num_inference_steps": args.steps,
                     "guidance_scale": 4.5, "max_sequence_length": 16},
        "algo": {"noise_level": 1.0, "sde_type": "sde", "sde_window_size": 3, "sde_window_range": [0, 6]},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": reward_functions},
        "n": args.n, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"prompts": TRAIN_PROMPTS[:args.prompts], "prompts_per_step": args.prompts, "lr": 0.003,
                    "steps": 10_000, **trainer},
    })


# --------------------------------------------------------------------------------------------------- prompts
def make_prompts(P: int, run: int, tag: int = 0, tags_per_run: int = 1) -> list[str]:
    """P distinct prompts, different for every (run, tag) with 0 <= tag < tags_per_run, so no engine ever re-encodes
    a prompt it has seen. Prompt number k = (run * tags_per_run + tag) * P + j, j < P."""
    out = []
    for j in range(P):
        k = (run * tags_per_run + tag) * P + j
        out.append(f"a photo of a {COLORS[k % len(COLORS)]} {SUBJECTS[(k // len(COLORS)) % len(SUBJECTS)]} "
                   f"{PLACES[(k // (len(COLORS) * len(SUBJECTS))) % len(PLACES)]} number {k}")
    return out


# --------------------------------------------------------------------------------------------------- model
def build_model(cache_dir: str, preset: str, layers: int | None = None) -> str:
    """The `build_tiny_sd3` checkpoint of `preset` under `cache_dir` (built once, then reused): `<preset>-sd3`, or with
    `layers` transformer layers instead of the preset's, `<preset>-sd3-L<layers>`."""
    from omniroll.models.tiny import build_tiny_sd3

    overrides = {} if layers is None else {"num_layers": layers}
    name = f"{preset}-sd3" if layers is None else f"{preset}-sd3-L{layers}"
    return build_tiny_sd3(os.path.join(cache_dir, name), seed=0, preset=preset, **overrides)


# --------------------------------------------------------------------------------------------------- machine
def record_loadavg(info: dict, key: str) -> None:
    """info[key] = the 1/5/15-minute load averages (left out where the OS has none)."""
    with contextlib.suppress(OSError):
        info[key] = [round(x, 2) for x in os.getloadavg()]


def emit_record(record: dict, path: str | None = None, default=None) -> None:
    """A benchmark's last line: `record` as one JSON line on stdout (`default` as json.dumps takes it), also written
    indented to `path` when given."""
    import json

    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record, default=default))


def machine_info(threads: int, extra_modules: tuple[str, ...] = ("diffusers",)) -> dict:
    """CPU model and count, library versions (torch + `extra_modules` that import), torch threads, load average."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": threads,
            "python": platform.python_version()}
    for name in extra_modules:
        with contextlib.suppress(Exception):
            info[name] = importlib.import_module(name).__version__
    record_loadavg(info, "loadavg_start")
    return info


def quiet_libraries(loggers=("diffusers", "transformers")) -> None:
    """Errors only from these loggers; no diffusers / transformers progress bars."""
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
    with contextlib.suppress(Exception):
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()


# --------------------------------------------------------------------------------------------------- timing / stats
def best_of(fn, repeats: int) -> float:
    """Minimum wall time of `fn()` over `repeats` runs (robust against a noisy shared machine)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def rotated(names: list, rep: int) -> list:
    """`names` rotated left by `rep` (the run order of repeat `rep`: every contender takes every position)."""
    k = rep % len(names)
    return names[k:] + names[:k]


def rnd(x, d: int = 4):
    """round(x, d), None stays None (JSON records)."""
    return None if x is None else round(x, d)


def timed(fn) -> tuple[float, float]:
    """(samples per wall second, CPU seconds of this process, every thread, per sample) of `fn()`, which returns how
    many samples it made."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def interleaved_rounds(contenders: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """`timed` of every contender, `rounds` times in turn after one warm-up run of each (every shape of the timed runs
    seen once): {name: [(samples/s, CPU s per sample), ...]}."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(rounds):
        for name, fn in contenders.items():
            out[name].append(timed(fn))
    return out


def print_versus(rounds: dict[str, list[tuple[float, float]]], result: dict, *, rate_key: str, rate_digits: int,
                 lead: str = "", suffix: str = "", base: str = "diffusers", shown_digits: int = 2) -> None:
    """One table row per contender of `interleaved_rounds`' output against `base`: `| {lead}name | median rate | best |
    median / base's | best / base's best | CPU ms per sample (median) | base's CPU / its |`; and into `result`
    `{rate_key}_{name}{suffix}` (the median rate), `ratio_...` and `cpu_ratio_...` (not for `base`)."""
    rates = {name: [r for r, _ in rs] for name, rs in rounds.items()}
    cpu = {name: statistics.median(c for _, c in rs) for name, rs in rounds.items()}
    med_base, best_base = statistics.median(rates[base]), max(rates[base])
    for name, r in rates.items():
        med, best = statistics.median(r), max(r)
        print(f"| {lead}{name} | {med:.{shown_digits}f} | {best:.{shown_digits}f} | {med / med_base:.2f}x "
              f"| {best / best_base:.2f}x | {1000 * cpu[name]:.0f} | {cpu[base] / cpu[name]:.2f}x |", flush=True)
        result[f"{rate_key}_{name}{suffix}"] = rnd(med, rate_digits)
        if name != base:
            result[f"ratio_{name}{suffix}"] = rnd(med / med_base, 3)
            result[f"cpu_ratio_{name}{suffix}"] = rnd(cpu[base] / cpu[name], 3)


# --------------------------------------------------------------------------------------------------- argparse
#: the engine's two rollout modes in the speed comparisons with diffusers' pipelines: the ODE without log-probs (what
#: a pipeline does), and an SDE window of 3 steps in the first 5 with fp32 log-probs (what a rollout for RL does)
ENGINE_MODES = {"ode": dict(noise_level=0.0, logprobs=False),
                "sde": dict(noise_level=0.8, sde_type="sde", sde_window_size=3, sde_window_range=(0, 5), logprobs=True)}


def seed_of(i: int) -> int:
    """The seed of the i-th sample of a speed comparison (the pipeline's generator and the engine's request)."""
    return 1_000 + i


class EngineContender:
    """omniroll's engine in a speed comparison: `run(mode)` draws one sample per prompt (`ENGINE_MODES[mode]` over
    `sampling`, seeds `seed_of(i)`, an empty negative prompt, the prompt cache cleared first so every run encodes its
    prompts, like a pipeline call) and checks each is a finished uint8 sample of `shape` (with finite log-probs on the
    SDE window); returns how many. `row_threads` > 1: the engine's row threads (`EngineConfig.row_threads`), each at
    one torch thread, instead of `threads` intra-op threads."""

    def __init__(self, path: str, prompts: list[str], sampling: dict, invariant: bool, rows: int, threads: int,
                 shape: tuple[int, ...], row_threads: int = 1):
        from omniroll.engine.engine import DiffusionEngine
        from omniroll.engine.params import SamplingParams

        self.engine = DiffusionEngine.from_pretrained(path, max_batch_size=rows, batch_invariant=invariant,
                                                      **({"row_threads": row_threads} if row_threads > 1
                                                         else {"num_threads": threads}))
        self.prompts, self.shape, self.runs = prompts, shape, 0
        self.params = {mode: SamplingParams(**sampling, **kw) for mode, kw in ENGINE_MODES.items()}

    def run(self, mode: str) -> int:
        return len(self.outputs(mode))

    def outputs(self, mode: str) -> list:
        """The checked outputs of one run."""
        from omniroll.engine.params import GenerationRequest

        self.runs += 1
        self.engine.call_between_steps(self.engine.prompt_cache.clear)
        reqs = [GenerationRequest(request_id=f"{mode}-{self.runs}-{i}", prompt=p, negative_prompt="",
                                  seed=seed_of(i), sampling_params=self.params[mode])
                for i, p in enumerate(self.prompts)]
        outs = self.engine.generate(reqs)
        assert all(o.stop_reason == "completed" and o.diffusion_output.dtype == torch.uint8
                   and tuple(o.diffusion_output.shape) == self.shape for o in outs)
        if mode == "sde":
            assert all(o.log_probs.shape == (3,) and torch.isfinite(o.log_probs).all() for o in outs)
        return outs


def at_threads(n: int, fn):
    """`fn` as a contender that sets torch's threads to `n` before each run (a row-thread engine runs torch at one
    thread, so the count a contender needs is set again before each of its runs)."""
    return lambda: (torch.set_num_threads(n), fn())[1]


def equal_outputs(a, b) -> bool:
    """Two lists of engine outputs are the same samples bitwise: pictures, fp32 log-probs, every step's latents, the
    sigmas and the step indices."""
    return all(torch.equal(x.diffusion_output, y.diffusion_output) and torch.equal(x.log_probs, y.log_probs)
               and x.log_probs.dtype == torch.float32
               and all(torch.equal(x.extra_fields[k], y.extra_fields[k]) for k in ("all_latents", "sigmas",
                                                                                  "step_indices"))
               for x, y in zip(a, b, strict=True))


def add_workload_args(ap: argparse.ArgumentParser, *, prompts: int, steps: int, size: int,
                      prompts_help: str = "unique prompts P") -> None:
    """The rollout workload: P prompts x n samples, T steps, CFG, SDE window, image size, text length."""
    ap.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    ap.add_argument("--steps", type=int, default=steps, help="denoising steps T")
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--window-size", type=int, default=3)
    ap.add_argument("--window-range", type=int, nargs=2, default=(0, 5))
    ap.add_argument("--height", type=int, default=size)
    ap.add_argument("--width", type=int, default=size)
    ap.add_argument("--max-sequence-length", type=int, default=64)


def add_run_args(ap: argparse.ArgumentParser, *, threads: int, threads_help: str | None = None,
                 seed_help: str | None = None) -> None:
    """Torch threads, repeats, the model cache directory and the seed."""
    ap.add_argument("--threads", type=int, default=threads, help=threads_help)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=".omniroll_cache")
    ap.add_argument("--seed", type=int, default=0, help=seed_help)


# ------------------------------------------------------------------------------------------- shapes evaluations
def run_evaluations(out_dir: str) -> dict:
    """A training run's task evaluations (`eval/before_<name>.json`, `eval/after_<name>.json`): per evaluation name,
    the before and after summaries (strict, se, n, categories), the paired comparison of the two (the same prompts
    and seeds: up, down, z per category and overall), the split and the guidance scale."""
    import json

    from omniroll.evaluation.paired import paired

    eval_dir = os.path.join(out_dir, "eval")
    out = {}
    for f in sorted(os.listdir(eval_dir)):
        if f.startswith("after_") and f.endswith(".json"):
            name = f[len("after_"):-len(".json")]
            with open(os.path.join(eval_dir, f"before_{name}.json")) as b, open(os.path.join(eval_dir, f)) as a:
                before, after = json.load(b), json.load(a)
            out[name] = {"before": picture_summary(before["pictures"]), "after": picture_summary(after["pictures"]),
                         "split": after["split"],
                         "guidance_scale": after["guidance_scale"],
                         "paired": paired(before["pictures"], after["pictures"]),
                         "pictures": (before["pictures"], after["pictures"])}
    return out


def picture_summary(pictures: list[dict]) -> dict:
    """strict (GenEval's overall: the category mean), se, n and per-category strict of an eval.json's pictures, and
    the share with extra objects where the pictures say (`extra_objects`: shapes pictures judged since it exists)."""
    from omniroll.tasks.shapes.report import Report, Scored

    rep = Report.from_rows([Scored(p["prompt"], p["tag"], p["strict"], p["partial"], p["chance"], extra=p.get("extra"))
                            for p in pictures])
    extra = {"extra_objects": rep.overall["extra_objects"]} if "extra_objects" in rep.overall else {}
    return {"strict": rep.overall["strict"], "se": rep.overall["se"], "n": rep.overall["n"],
            "categories": {t: c["strict"] for t, c in rep.categories.items()}, **extra}
