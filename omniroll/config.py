"""One YAML config for rollout, validated into typed pydantic objects.

Key names follow VeRL-Omni's `rollout` config where they mean the same thing (`pipeline.*`, `algo.*`,
`agent.num_workers`, `agent.default_agent_loop`, `val_kwargs`, `seed`, `n`, `prompt_length`,
`max_prompt_embed_length`, `calculate_log_probs`). Unknown keys and bad values raise `ConfigError` naming the dotted
key, e.g. `pipeline.heigth: Extra inputs are not permitted`.

    cfg = load_config("rollout.yaml", overrides=["pipeline.height=64", "replicas.count=2"])
    cfg.sampling_params()                # training sampling dict
    cfg.sampling_params(validate=True)   # validation: val_kwargs overlay, noise_level 0, logprobs False

Naming: a YAML section is a `*Section` class (`EngineSection`, `RewardSection`, ...); `*Config` names belong to the
components themselves (`omniroll.engine.config.EngineConfig`, `omniroll.reward.RewardConfig`), so each name means
one thing.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from omniroll.engine.params import (Fps, GuidanceScale, NoiseLevel, NumFrames, OutputType, Pixels, SamplingParams,
                                    SdeType, SequenceLength, Steps, TrueCfgScale, WindowRange, WindowSize,
                                    overlay_sampling)
from omniroll.errors import format_validation_error, validation_messages
from omniroll.reward.manager import RewardConfig as RewardWorkerConfig  # the reward workers' own config
from omniroll.reward.manager import RewardFunctionConfig


class ConfigError(ValueError):
    """A bad config; the message names every offending dotted key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: a Ray placement-group strategy, one bundle per actor (omniroll.rollout.ray_cluster)
Placement = Literal["pack", "spread"]


def _custom_only(resources: dict) -> dict:
    bad = [k for k in resources if k in ("CPU", "GPU", "memory", "object_store_memory")]
    if bad:
        raise ValueError(f"custom resources only ({bad[0]!r} is set by num_cpus / num_gpus)")
    return resources


#: custom Ray resources per actor, e.g. {"a100_node": 1}
Resources = Annotated[dict[str, Annotated[float, Field(gt=0)]], AfterValidator(_custom_only)]


class ReplicasSection(_Strict):
    count: int = Field(1, ge=1, le=1024)
    num_cpus: float = Field(1.0, ge=0, allow_inf_nan=False)
    num_gpus: float = Field(0.0, ge=0, allow_inf_nan=False)
    max_concurrency: int = Field(1000, ge=1)
    placement: Placement = Field("pack", description="pack: replicas together; spread: on distinct nodes when it can")
    resources: Resources = Field(default_factory=dict, description="custom Ray resources each replica needs")


class EngineSection(_Strict):
    model: str = Field("tiny", min_length=1, description='a diffusers checkpoint path, or "tiny" (built on demand)')
    max_batch_size: Union[Literal["auto"], int] = Field(
        16, description='forward rows per batch key; "auto": measured per shape (omniroll.engine.calibrate)')
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_threads: Optional[int] = Field(None, ge=1, le=1024, description="torch threads per replica (same on all)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra DiffusionEngine.from_pretrained kwargs")

    @field_validator("max_batch_size", mode="before")
    @classmethod
    def _rows_or_auto(cls, value):
        from omniroll.engine.config import check_max_batch_size  # the engine's rule (imported late: torch)

        return check_max_batch_size(value, name=None)

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value):
        """A tiny name, or a local diffusers checkpoint directory (nothing is built or loaded here)."""
        from omniroll.models import TINY_MODELS, resolve_model

        if value not in TINY_MODELS:
            try:
                resolve_model(value)
            except FileNotFoundError as e:
                raise ValueError(str(e)) from None
        return value

    @field_validator("kwargs")
    @classmethod
    def _known_engine_kwargs(cls, value):
        """Only `omniroll.engine.EngineConfig` fields the section does not set itself, with values it accepts."""
        from omniroll.engine.config import EngineConfig  # imports torch: not at module import (`omniroll --help`)

        allowed = sorted({f.name for f in dataclasses.fields(EngineConfig)} - set(cls.model_fields))
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}: engine.kwargs takes EngineConfig fields {allowed}")
        try:
            EngineConfig(**value)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return value

    def engine_kwargs(self) -> dict:
        kw = {"device": self.device, "dtype": self.dtype, "max_batch_size": self.max_batch_size, **self.kwargs}
        if self.num_threads is not None:
            kw["num_threads"] = self.num_threads
        return kw


# The sampling sections: each field's type and bounds are `omniroll.engine.params`'s (one declaration per field).
class PipelineSection(_Strict):
    height: Pixels = 512
    width: Pixels = 512
    num_frames: NumFrames = Field(1, description="1 for images; video models: their rule (Wan: 4k + 1)")
    fps: Fps = 16
    num_inference_steps: Steps = 10
    guidance_scale: GuidanceScale = 4.5
    true_cfg_scale: TrueCfgScale = Field(1.0, description="guidance-distilled models (FLUX.1) only")
    max_sequence_length: SequenceLength = 128
    output_type: OutputType = "pixel"


class AlgoSection(_Strict):
    noise_level: NoiseLevel = 0.7
    sde_type: SdeType = "sde"
    sde_window_size: Optional[WindowSize] = None
    sde_window_range: Optional[WindowRange] = None
    same_latent: bool = Field(False, description="training samples of a prompt group share their initial noise and "
                                                 "SDE window (flow_grpo's same_latent); their ODE prefix runs once")


class _PartialPipeline(_Strict):
    height: Optional[Pixels] = None
    width: Optional[Pixels] = None
    num_frames: Optional[NumFrames] = None
    num_inference_steps: Optional[Steps] = None
    guidance_scale: Optional[GuidanceScale] = None
    max_sequence_length: Optional[SequenceLength] = None


class _PartialAlgo(_Strict):
    noise_level: NoiseLevel = 0.0
    sde_type: Optional[SdeType] = None
    sde_window_size: Optional[WindowSize] = None
    sde_window_range: Optional[WindowRange] = None


class ValKwargs(_Strict):
    """Validation overlay. By default every row gets its own seed derived from `seed`; `seed_mode: shared` gives
    every row the seed `seed` itself (VeRL-Omni's validation semantics: the samples of one prompt are identical)."""

    n: int = Field(1, ge=1)
    seed: int = Field(42, ge=0)
    seed_mode: Literal["per_row", "shared"] = "per_row"
    pipeline: _PartialPipeline = Field(default_factory=_PartialPipeline)
    algo: _PartialAlgo = Field(default_factory=_PartialAlgo)


class AgentSection(_Strict):
    num_workers: int = Field(2, ge=1, le=1024)
    default_agent_loop: str = "diffusion_single_turn_agent"
    on_failure: Literal["raise", "mark"] = Field(
        "raise", description="raise: one error listing failed rows; mark: return them with status 'failed'"
    )
    placement: Placement = "pack"
    resources: Resources = Field(default_factory=dict)

    @field_validator("default_agent_loop")
    @classmethod
    def _registered(cls, value):
        from omniroll.agent_loop.registry import registered_names

        if value not in registered_names():
            raise ValueError(f"agent loop {value!r} is not registered; registered: {registered_names()} (import the "
                             f"module whose @register(...) defines it before loading the config)")
        return value


class RewardSection(RewardWorkerConfig):
    """The reward workers' own config (`omniroll.reward.RewardConfig`: `functions` of `RewardFunctionConfig`,
    micro-batching knobs) plus how many workers to start; an empty `functions` means no streaming reward."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_workers: int = Field(1, ge=0, le=1024)
    functions: dict[str, RewardFunctionConfig] = Field(default_factory=dict)
    placement: Placement = "pack"
    resources: Resources = Field(default_factory=dict)

    def worker_config(self) -> dict:
        """What `omniroll.reward.create_reward_workers` takes."""
        return {"functions": dict(self.functions), "max_batch_size": self.max_batch_size,
                "max_wait_ms": self.max_wait_ms}


class LoRASection(_Strict):
    rank: int = Field(8, ge=1, le=4096)
    alpha: float = Field(16.0, gt=0, le=1e6)
    target_modules: Optional[list[str]] = Field(None, min_length=1, description="module names (PEFT target_modules); "
                                                "None: the family's default (its attention projections)")


#: `trainer.logger` backends (omniroll.train.tracking; the last four are optional extras)
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow")


class TrainerSection(_Strict):
    """The reference Flow-GRPO trainer (`omniroll train`). Group size is the top-level `n`; sampling comes from
    `pipeline` / `algo`; rewards from `reward`; validation images from `val_kwargs` (ODE)."""

    steps: int = Field(20, ge=1, le=10**7)
    prompts: list[str] = Field(default_factory=list, description="training prompts (or prompts_file)")
    prompts_file: Optional[str] = Field(None, description="one prompt per line, added to prompts")
    val_prompts: list[str] = Field(default_factory=list, description="fixed validation prompts (default: the "
                                                                     "first 4 training prompts)")
    prompts_per_step: int = Field(4, ge=1, le=100_000)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0, le=10)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    clip_range: float = Field(1e-4, gt=0, le=10, description="PPO clip epsilon")
    adv_clip_max: float = Field(5.0, gt=0, le=1e6)
    global_std: bool = Field(False, description="normalise advantages by the whole batch's std, not the group's")
    kl_beta: float = Field(0.0, ge=0, le=1e6, description="KL to the base model (LoRA: adapter disabled)")
    num_inner_epochs: int = Field(1, ge=1, le=1000)
    micro_batch_size: int = Field(8, ge=1, le=100_000, description="samples per forward")
    micro_batches_per_update: Optional[int] = Field(None, ge=1, description="gradient accumulation: micro-batches "
                                                    "per optimizer step; None: one step per inner epoch")
    max_grad_norm: float = Field(1.0, gt=0)
    mode: Literal["lora", "full"] = "lora"
    lora: LoRASection = Field(default_factory=LoRASection)
    window_schedule: Literal["fixed", "random", "progressive"] = Field(
        "fixed", description="MixGRPO-style SDE window per step: fixed (algo.sde_window_*), random (from seed and "
                             "step), progressive (advances by the window size every window_advance_every steps)")
    window_advance_every: int = Field(1, ge=1)
    gradient_checkpointing: bool = False
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints (0: only the final one)")
    val_every: int = Field(0, ge=0, description="steps between validation grids (0: before and after only)")
    seed: int = Field(0, ge=0, description="trainer seed: prompt order, shuffling, adapter init")
    weight_transport: Literal["auto", "object_store", "ray", "shm"] = Field(
        "auto", description="auto: /dev/shm for replicas on the trainer's node, the Ray object store for the others")
    sync_timeout_s: float = Field(600.0, gt=0)
    num_threads: Optional[int] = Field(None, ge=1, le=1024, description="torch threads of the trainer process "
                                       "(None: torch's default); 1 is far faster on a busy small CPU")
    # asynchronous training (README "Asynchronous training"; omniroll/train/async_rollout.py, objective.py)
    max_staleness: int = Field(0, ge=0, le=1000, description="K: 0 is the synchronous trainer; K >= 1 rolls out the "
                               "next step(s) while a step trains, and trains a sample only if every window step "
                               "ran with weight version >= current - K")
    partial_rollout: bool = Field(False, description="False: a weight sync waits for in-flight samples to finish; "
                                  "True: it lands between two denoise steps and they continue with the new weights")
    on_stale: Literal["drop", "wait"] = Field("drop", description="a sample older than max_staleness: dropped "
                                              "(counted) or regenerated with the current weights (the trainer waits)")
    old_log_prob: Literal["rollout", "recompute"] = Field(
        "rollout", description="the behaviour log-prob: as the engine recorded it, or recomputed by the trainer "
                               "under the weight version that ran each window step")
    behaviour_weight_cap: float = Field(2.0, ge=1.0, le=1e6, description="truncation of the importance weight "
                                        "pi_prox / pi_behaviour per window step (>= 1, so K = 0 is exact)")
    # experiment tracking (verl's key names; omniroll.train.tracking)
    logger: list[str] = Field(default_factory=lambda: ["console", "jsonl"], description="any of console, jsonl, "
                              "tensorboard, wandb, swanlab, mlflow (the last four: optional extras)")
    project_name: str = Field("omniroll", min_length=1)
    experiment_name: Optional[str] = Field(None, min_length=1, description="default: {model}-{mode}-{time}; a "
                                           "resumed run keeps its own")
    log_images_every: int = Field(10, ge=0, description="steps between captioned training samples (0: never)")
    log_images_count: int = Field(4, ge=0, le=64, description="training samples per image log (one per prompt)")

    def all_prompts(self) -> list[str]:
        prompts = list(self.prompts)
        if self.prompts_file:
            prompts += [ln.strip() for ln in Path(self.prompts_file).read_text().splitlines() if ln.strip()]
        return prompts

    @field_validator("logger", mode="before")
    @classmethod
    def _logger_list(cls, value):
        names = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
        if isinstance(names, (list, tuple)):
            bad = [n for n in names if n not in LOGGERS]
            if bad:
                raise ValueError(f"unknown logger(s) {bad}: allowed {', '.join(LOGGERS)}")
            if len(set(names)) != len(names):
                raise ValueError(f"names a logger twice: {list(names)}")
        return names

    @model_validator(mode="after")
    def _check(self):
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ValueError(f"prompts_file: file not found: {self.prompts_file}")
        n = len(self.all_prompts())
        if n == 0:
            raise ValueError("prompts: training needs at least one prompt (prompts or prompts_file)")
        if self.prompts_per_step > n:
            raise ValueError(f"prompts_per_step: must be <= the number of prompts ({n}), got {self.prompts_per_step}")
        return self


class OmniRollConfig(_Strict):
    replicas: ReplicasSection = Field(default_factory=ReplicasSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    n: int = Field(1, ge=1, description="samples per prompt (the group size)")
    seed: Optional[int] = Field(None, ge=0, description="rollout seed base; None = 0")
    calculate_log_probs: bool = True
    prompt_length: int = Field(512, ge=1)
    max_prompt_embed_length: Optional[int] = Field(None, ge=1)
    timeout_s: float = Field(600.0, gt=0)
    max_retries: int = Field(2, ge=0, le=100)
    trainer: Optional[TrainerSection] = None

    @field_validator("pipeline", "val_kwargs")
    @classmethod
    def _fits_model(cls, value, info: ValidationInfo):
        """Resolution and text length against the model's limits (read from its config files; a tiny model is
        built once, as every command does next): `pipeline.*` and the `val_kwargs.pipeline.*` it overrides."""
        engine = info.data.get("engine")
        if engine is None:  # engine.model is itself wrong (reported there)
            return value
        from omniroll.models import read_limits, resolve_model

        limits = read_limits(resolve_model(engine.model))
        p = value if info.field_name == "pipeline" else value.pipeline
        problems = [] if limits is None else limits.problems(
            p.height, p.width, p.max_sequence_length, prefix="" if info.field_name == "pipeline" else "pipeline.")
        if problems:
            raise ValueError("; ".join(m.replace(" must", ": must", 1) for m in problems))
        return value

    @model_validator(mode="after")
    def _check_training(self):
        if self.trainer is None:
            return self
        if not self.reward.functions or self.reward.num_workers < 1:
            raise ValueError("reward.functions: training needs at least one reward function and reward.num_workers >= 1")
        if self.algo.sde_type == "ode" or self.algo.noise_level <= 0:
            raise ValueError("algo.sde_type / algo.noise_level: training needs a stochastic step (sde, cps or "
                             f"dance_sde with noise_level > 0), got {self.algo.sde_type} at {self.algo.noise_level}")
        if not self.calculate_log_probs:
            raise ValueError("calculate_log_probs: training needs the rollout's log-probs")
        if self.n < 2:
            raise ValueError(f"n: GRPO needs groups of at least 2 samples per prompt, got {self.n}")
        if self.trainer.window_schedule != "fixed" and self.algo.sde_window_size is None:
            raise ValueError(f"trainer.window_schedule: {self.trainer.window_schedule!r} moves a window of "
                             f"algo.sde_window_size steps; set algo.sde_window_size")
        return self

    @model_validator(mode="after")
    def _check_prompt_length(self):
        from omniroll.models import prompt_ids_length

        n = prompt_ids_length(self.engine.model)
        if n is not None and self.prompt_length < n:
            raise ValueError(f"prompt_length: must be >= {n}: the model's tokenizer pads prompt ids to {n} tokens "
                             f"(engine.model={self.engine.model!r}), got {self.prompt_length}")
        return self

    @model_validator(mode="after")
    def _check_sampling(self):
        # the training and validation sampling dicts must both be valid SamplingParams
        for validate, section in ((False, ""), (True, "val_kwargs.")):
            try:
                SamplingParams.model_validate(self.sampling_params(validate=validate))
            except ValidationError as e:
                raise ValueError(format_validation_error(
                    e, with_input=False, empty_loc=f"{section}algo",
                    locate=lambda loc: (f"{section}{_SECTION.get(str(loc[0]), '')}{'.'.join(map(str, loc))}"
                                        if loc else ""))) from None
        return self

    def sampling_params(self, validate: bool = False) -> dict:
        """The per-request sampling dict (SamplingParams fields)."""
        sp = {**self.pipeline.model_dump(), **self.algo.model_dump(exclude={"same_latent"}),
              "logprobs": self.calculate_log_probs}
        if not validate:
            return sp
        val = {**self.val_kwargs.pipeline.model_dump(exclude_none=True),
               **self.val_kwargs.algo.model_dump(exclude_none=True)}  # noise_level: always set (default 0, the ODE)
        return overlay_sampling(sp, val, validate=True)


_SECTION = {k: "pipeline." for k in PipelineSection.model_fields} | {k: "algo." for k in AlgoSection.model_fields}


def load_config(
    path_or_dict: Union[str, Path, dict, "OmniRollConfig", None] = None, overrides: Optional[list[str]] = None
) -> OmniRollConfig:
    """YAML path / dict / DictConfig / None (defaults), plus OmegaConf dotlist overrides ("pipeline.height=64")."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(path_or_dict, OmniRollConfig):
        base = OmegaConf.create(path_or_dict.model_dump(mode="json"))
    elif path_or_dict is None:
        base = OmegaConf.create({})
    elif isinstance(path_or_dict, (str, Path)):
        p = Path(path_or_dict)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        base = OmegaConf.load(p)
    elif isinstance(path_or_dict, (dict, DictConfig)):
        base = OmegaConf.create(path_or_dict)
    else:
        raise ConfigError(f"load_config takes a path, dict or DictConfig, got {type(path_or_dict).__name__}")
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like 'dotted.key=value', got {bad}")
        base = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
    raw = OmegaConf.to_container(base, resolve=True)
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a mapping at the top level, got {type(raw).__name__}")
    return validate_config(raw)


def validate_config(raw: dict) -> OmniRollConfig:
    try:
        return OmniRollConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("invalid config: " + "; ".join(config_messages(e))) from None


_SUBKEY = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*): (.+)$", re.S)


def config_messages(error: ValidationError) -> list[str]:
    """One `dotted.key: what is wrong` per problem. A section's validator that names its own key in its message
    (`height: must be ...`, `kwargs.model_dir: directory not found: ...`) is reported under the full key
    (`pipeline.height: ...`); several problems joined by "; " in one message become one line each."""
    out = []
    for err, line in zip(error.errors(), validation_messages(error)):
        key = ".".join(str(p) for p in err.get("loc") or ())
        parts = str(err.get("msg", "")).removeprefix("Value error, ").split("; ")
        if not key or not any(_SUBKEY.match(p) for p in parts):
            out.append(line)
            continue
        for part in parts:
            m = _SUBKEY.match(part)
            out.append(f"{key}.{m.group(1)}: {m.group(2)}" if m else f"{key}: {part}")
    return out
