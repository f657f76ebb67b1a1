"""What every command shares: the config flags (defaults from the config schema), prompts, the seed derivation,
and the checks that run before anything expensive starts.

Flags are shorthands for config keys (`--height` is `pipeline.height`); a flag left out takes the value from
`--config`, else the schema's default (`omniroll.config`), so there is one set of defaults. Order of precedence:
$OMNIROLL_OVERRIDES > flag > `--override key=value` > `--config` file > schema default.

`OMNIROLL_OVERRIDES` (space-separated `key=value` config overrides, applied last and recorded in metrics.json) shrinks
every command at once, e.g. to run the docs' commands at toy size in CI.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, get_args

from omniroll.cli.errors import UserError

ENV_OVERRIDES = "OMNIROLL_OVERRIDES"


def rows_or_auto(text: str):
    """--max-batch-size: parsed to an int or "auto"; its range is checked by the config (`check_max_batch_size`)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 2 or 'auto', got {text!r}") from None


@dataclass(frozen=True)
class Flag:
    flag: str
    key: str  # dotted config key
    type: Any
    help: str
    nargs: Optional[int] = None
    choices: bool = False  # the values the schema's Literal allows (declared once, in the schema)


FLAGS = [
    Flag("--model", "engine.model", str, "'tiny' or 'tiny-<family>' (sd3, flux, qwen-image, wan, wan2.2; built "
         "offline) or a local diffusers SD3 / SD3.5, FLUX.1, Qwen-Image or Wan checkpoint directory"),
    Flag("--device", "engine.device", str, "torch device of the model, e.g. cpu, cuda, cuda:1"),
    Flag("--dtype", "engine.dtype", str, "model weights' dtype (the SDE math and log-probs are always fp32)",
         choices=True),
    Flag("--max-batch-size", "engine.max_batch_size", rows_or_auto, "forward rows per denoising step (a CFG sample "
         "takes 2), or 'auto': measured per shape (see omniroll.engine.calibrate)"),
    Flag("--num-threads", "engine.num_threads", int, "torch CPU threads per engine (unset: torch's choice)"),
    Flag("--height", "pipeline.height", int, "image height in pixels (a multiple of the model's spatial factor)"),
    Flag("--width", "pipeline.width", int, "image width in pixels"),
    Flag("--frames", "pipeline.num_frames", int, "video frames (Wan: 4k + 1); 1 for images"),
    Flag("--fps", "pipeline.fps", int, "frames per second of written videos"),
    Flag("--steps", "pipeline.num_inference_steps", int, "denoising steps"),
    Flag("--solver", "pipeline.solver", str, "the deterministic steps' solver (every step at noise level 0; outside "
         "the SDE window otherwise)", choices=True),
    Flag("--guidance", "pipeline.guidance_scale", float, "CFG scale (<= 1 turns CFG off); FLUX.1: the distilled "
         "guidance given to the model"),
    Flag("--true-cfg", "pipeline.true_cfg_scale", float, "FLUX.1 only: real CFG on top of the distilled guidance"),
    Flag("--max-sequence-length", "pipeline.max_sequence_length", int, "T5 text length in tokens"),
    Flag("--noise-level", "algo.noise_level", float, "SDE noise level eta (0: the ODE)"),
    Flag("--sde-type", "algo.sde_type", str, "SDE step", choices=True),
    Flag("--window-size", "algo.sde_window_size", int,
         "SDE steps recorded per sample (unset: every step but the last)"),
    Flag("--window-range", "algo.sde_window_range", int, "LO HI: the window is drawn inside steps [LO, HI)", nargs=2),
    Flag("--n", "n", int, "samples per prompt (the group size)"),
    Flag("--seed", "seed", int, "base seed of every sample's seed (unset: 0)"),
]


def _field(key: str):
    """The config schema's field of a dotted key (walks the classes: building the config would run its validators,
    which load models)."""
    from omniroll.config import OmniRollConfig

    cls: Any = OmniRollConfig
    *sections, name = key.split(".")
    for part in sections:
        cls = cls.model_fields[part].annotation
    return cls.model_fields[name]


def schema_default(key: str) -> Any:
    """The config schema's default for a dotted key (the one set of defaults)."""
    from pydantic_core import PydanticUndefined

    field = _field(key)
    return field.default_factory() if field.default is PydanticUndefined and field.default_factory else field.default


def add_config_arguments(parser, config_help: str = "YAML config (see examples/rollout.yaml); flags override it",
                         config_required: bool = False) -> None:
    parser.add_argument("--config", required=config_required, default=None,
                        help=config_help + ("" if config_required else " (default: none: the schema's defaults)"))
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted config override (repeatable), e.g. reward.num_workers=2")
    for f in FLAGS:
        default = schema_default(f.key)
        shown = list(default) if isinstance(default, tuple) else default
        # SUPPRESS: a flag left out leaves no attribute, so the config (or the schema default shown) decides
        choices = get_args(_field(f.key).annotation) if f.choices else None
        parser.add_argument(f.flag, type=f.type, nargs=f.nargs, choices=choices, default=argparse.SUPPRESS,
                            metavar=("LO", "HI") if f.nargs == 2 else None,
                            help=f"{f.help} (config key {f.key}; default: {shown})")


def add_prompt_arguments(parser) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; default: none)")
    parser.add_argument("--prompts-file", "--prompts", dest="prompts_file", default=None,
                        help="a text file, one prompt per line (blank lines skipped) (default: none)")


def flag_overrides(args) -> list[str]:
    """The flags the user gave, as dotted overrides."""
    import json

    out = []
    for f in FLAGS:
        value = getattr(args, f.flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            out.append(f"{f.key}={json.dumps(value)}")
    return out


def env_overrides() -> list[str]:
    """`$OMNIROLL_OVERRIDES` as a list of `key=value` overrides."""
    import shlex

    return shlex.split(os.environ.get(ENV_OVERRIDES, ""))


def env_override(key: str) -> Optional[str]:
    """The last `key=value` of `$OMNIROLL_OVERRIDES` that sets `key` (None when it sets none): a flag that stands for
    that key yields to it (the order of precedence above)."""
    found = [o for o in env_overrides() if o.split("=", 1)[0] == key]
    return found[-1] if found else None


def build_config(args, base: Optional[dict] = None):
    """The validated config: schema defaults < `base` < --config < --override < flags. UserError, one line per bad
    key, naming the flag where a flag set it."""
    from omegaconf import OmegaConf

    from omniroll.config import ConfigError, load_config

    if args.config is not None and not os.path.isfile(args.config):
        raise UserError(f"--config: file not found: {args.config}")
    bad = [o for o in args.override if "=" not in o]
    if bad:
        raise UserError([f"--override: expected KEY=VALUE, got {o!r}" for o in bad])
    bad = [o for o in env_overrides() if "=" not in o]
    if bad:
        raise UserError([f"${ENV_OVERRIDES}: expected KEY=VALUE, got {o!r}" for o in bad])
    raw = OmegaConf.create(base or {})
    if args.config is not None:
        try:
            raw = OmegaConf.merge(raw, OmegaConf.load(args.config))
        except Exception as e:  # noqa: BLE001 - YAML syntax errors have many types
            raise UserError(f"--config: {args.config} is not valid YAML: {str(e).splitlines()[0]}") from None
    try:
        cfg = load_config(raw, overrides=list(args.override) + flag_overrides(args) + env_overrides())
    except ConfigError as e:
        raise UserError(_name_flags(str(e).removeprefix("invalid config: ").split("; "))) from None
    except Exception as e:  # noqa: BLE001 - omegaconf's override parser errors
        raise UserError(f"--override: {str(e).splitlines()[0]}") from None
    return cfg


def _name_flags(problems: list[str]) -> list[str]:
    """`pipeline.height: ...` -> `--height (pipeline.height): ...` for keys that have a flag."""
    flags = {f.key: f.flag for f in FLAGS}
    out = []
    for p in problems:
        key, sep, rest = p.partition(":")
        out.append(f"{flags[key]} ({key}):{rest}" if sep and key in flags else p)
    return out


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UserError(f"--prompts-file: file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--prompts-file: cannot read {path} as UTF-8 text: {e}") from None
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UserError(f"--prompts-file: {path} has no prompts (one per line)")
    if not prompts:
        raise UserError("give at least one --prompt or a --prompts-file")
    return prompts


def quiet_libraries() -> None:
    """Silence diffusers' and transformers' loading bars and warnings (for --quiet)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for lib in (diffusers_logging, transformers_logging):
        lib.disable_progress_bar()
        lib.set_verbosity_error()


def sample_seed(base: Optional[int], uid: str, index: int) -> int:
    """A CLI sample's seed: the agent loop's derivation (`derive_seed(base, step, uid, index)`) at the CLI's step."""
    from omniroll.sampling.seeds import CLI_GLOBAL_STEP, derive_seed

    return derive_seed(base, CLI_GLOBAL_STEP, uid, index)


def preflight(cfg, prompts: list[str]) -> str:
    """What the config itself cannot check before a model or Ray starts (the config checked the model path, its
    resolution and text limits, and the reward functions); returns the resolved model directory. UserError with one
    line per problem, each naming its flag or config key."""
    from omniroll.models import resolve_model

    try:
        model = resolve_model(cfg.engine.model)
    except FileNotFoundError as e:
        raise UserError(f"--model (engine.model): {e}") from None
    problems = _cuda_problems(cfg.engine.device) if cfg.engine.device.startswith("cuda") else []
    problems += reward_prompt_problems(cfg, prompts)
    if problems:
        raise UserError(problems)
    return model


def nearest_existing(path: str) -> str:
    """`path` (absolute) if it exists, else its nearest existing parent."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def directory_problem(path: str) -> Optional[str]:
    """Why `path` cannot be (or become) a directory this process writes, or None: it is a file, or its nearest existing
    parent is a file or not writable. Nothing is created."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        return "is a file, not a directory"
    existing = nearest_existing(full)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be created: {existing} is not writable"
    return None


def check_out_dir(path: str, flag: str = "--out") -> None:
    """An output directory flag, before any work starts: UserError naming the flag when the directory cannot be
    written (`directory_problem`)."""
    problem = directory_problem(path)
    if problem:
        raise UserError(f"{flag} {path}: {problem}")


def reward_prompt_problems(cfg, prompts: list[str]) -> list[str]:
    """Prompts a configured reward function cannot score (`omniroll.reward.scorers.prompt_problems`), each line
    naming the function's config key."""
    from omniroll.reward.scorers import prompt_problems

    return [f"reward.functions.{name}: {line}" for name, f in cfg.reward.functions.items()
            for line in prompt_problems(f.fn, prompts)]


def _cuda_problems(device: str) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return [f"--device (engine.device): {device!r} asked for, but torch sees no CUDA device "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})"]
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return [f"--device (engine.device): {device!r}, but only {torch.cuda.device_count()} CUDA device(s) exist"]
    return []
