"""One YAML config for rollout, validated into typed pydantic objects.

Key names follow VeRL-Omni's `rollout` config where they mean the same thing (`pipeline.*`, `algo.*`,
`agent.num_workers`, `agent.default_agent_loop`, `val_kwargs`, `seed`, `n`, `prompt_length`,
`max_prompt_embed_length`, `calculate_log_probs`). Unknown keys and bad values raise `ConfigError` naming the dotted
key, an unknown key with the nearest key of its section: `pipeline.heigth: Extra inputs are not permitted (did you
mean pipeline.height?)`.

    cfg = load_config("rollout.yaml", overrides=["pipeline.height=64", "replicas.count=2"])
    cfg.sampling_params()                # training sampling dict
    cfg.sampling_params(validate=True)   # validation: val_kwargs overlay, noise_level 0, logprobs False

Naming: a YAML section is a `*Section` class (`EngineSection`, `RewardSection`, ...); `*Config` names belong to the
components themselves (`omniroll.engine.config.EngineConfig`, `omniroll.reward.RewardConfig`), so each name means
one thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from omniroll.config.algorithms import ALGORITHMS, cfg_free_rollout, check_algorithm, check_tree_training
from omniroll.config.device import check_trainer_device
from omniroll.config.sections import (AgentSection, AlgoSection, ConfigError, EngineSection, PipelineSection,
                                      Placement, ReplicasSection, Resources, RewardSection, ValKwargs, PartialAlgo,
                                      PartialPipeline, _Strict)
from omniroll.config.trainer import LOGGERS, EvaluationSection, LoRASection, SignalCheckSection, TrainerSection
from omniroll.engine.params import SamplingParams, overlay_sampling
from omniroll.errors import config_messages, format_validation_error

__all__ = ["ALGORITHMS", "AgentSection", "AlgoSection", "ConfigError", "EngineSection", "EvaluationSection", "LOGGERS",
           "LoRASection", "OmniRollConfig", "PipelineSection", "Placement", "ReplicasSection", "Resources",
           "RewardSection", "SignalCheckSection", "TrainerSection", "ValKwargs", "PartialAlgo", "PartialPipeline",
           "config_messages", "load_config", "validate_config"]


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
    calculate_log_probs: bool = Field(True, description="record SDE log-probs (training needs them)")
    prompt_length: int = Field(512, ge=1, description="prompt token ids per row in the batch (padded; at least the "
                                                      "tokenizer's padded length)")
    max_prompt_embed_length: Optional[int] = Field(None, ge=1, description="a row whose prompt embeddings have more "
                                                   "tokens fails, naming it (None: no limit)")
    timeout_s: float = Field(600.0, gt=0, description="the routing client's deadline per sample on a replica")
    max_retries: int = Field(2, ge=0, le=100, description="times a sample is re-run on another replica after a "
                                               "replica failure (same seed)")
    trainer: Optional[TrainerSection] = None

    @field_validator("pipeline", "val_kwargs")
    @classmethod
    def _fits_model(cls, value, info: ValidationInfo):
        """Resolution and text length against the model's limits (read from its config files, or a tiny model's
        constants: nothing is built): `pipeline.*` and the `val_kwargs.pipeline.*` it overrides."""
        engine = info.data.get("engine")
        if engine is None:  # engine.model is itself wrong (reported there)
            return value
        from omniroll.models import model_limits

        limits = model_limits(engine.model)
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
            raise ValueError("reward.functions: training needs at least one reward function and "
                             "reward.num_workers >= 1")
        check_algorithm(self.trainer, self.algo)  # the keys it reads, the rollout it needs
        check_trainer_device(self)  # trainer.device / dtype / sharding, replicas.colocate
        log_probs = ALGORITHMS[self.trainer.algorithm].rollout == "sde_window"
        if log_probs and (self.algo.sde_type == "ode" or self.algo.noise_level <= 0):
            raise ValueError("algo.sde_type / algo.noise_level: training needs a stochastic step (sde, cps or "
                             f"dance_sde with noise_level > 0), got {self.algo.sde_type} at {self.algo.noise_level}")
        if log_probs and not self.calculate_log_probs:
            raise ValueError("calculate_log_probs: training needs the rollout's log-probs")
        if log_probs and self.engine.merge_lora:
            raise ValueError(f"engine.merge_lora: trainer.algorithm {self.trainer.algorithm} takes the ratio of its "
                             f"recompute (the adapter unmerged) to the rollout's log-probs, which merged weights do "
                             f"not reproduce bitwise; set it false (it is for algorithms without a ratio: nft, awm)")
        weighted = [k for k, f in self.reward.functions.items() if f.weight != 0]
        if self.trainer.signal_components and len(weighted) < 2:
            raise ValueError(f"trainer.signal_components compares each reward function's update direction with the "
                             f"total's: reward.functions needs at least 2 of nonzero weight, got {weighted}")
        gate = self.trainer.kl_gate
        unknown = [k for k in (gate.against if gate is not None else []) if k not in self.reward.functions]
        if unknown:
            raise ValueError(f"trainer.kl_gate.against: {unknown[0]!r} is not a reward function (reward.functions: "
                             f"{sorted(self.reward.functions)})")
        if self.n < 2:
            raise ValueError(f"n: GRPO needs groups of at least 2 samples per prompt, got {self.n}")
        if self.trainer.evaluation is not None:
            from omniroll.models import model_task

            task = model_task(self.engine.model)
            if self.trainer.evaluation.task != task:
                raise ValueError(f"trainer.evaluation.task: {self.engine.model!r} draws for the {task} world (its "
                                 f"omniroll_defaults.json task), so its evaluation is task: {task}; got "
                                 f"{self.trainer.evaluation.task!r}")
        if self.trainer.data_regularizer is not None:  # renders of the model's world at the rollout's size
            from omniroll.models import model_task
            from omniroll.tasks.renders import check_render_size

            p = self.pipeline
            check_render_size(model_task(self.engine.model), p.height, p.width, p.num_frames,
                              self.trainer.all_prompts(), "trainer.data_regularizer")
        if self.trainer.evaluation is not None and self.val_kwargs.seed_mode == "shared":
            raise ValueError("val_kwargs.seed_mode: trainer.evaluation draws every picture of a prompt at its own "
                             "fixed seed; 'shared' would make them one picture (use per_row)")
        from omniroll.reward.scorers import prompt_problems

        for key, prompts in (("trainer.prompts", self.trainer.all_prompts()), ("trainer.val_prompts",
                                                                             self.trainer.val_prompts)):
            fns = [*self.reward.functions.values(), *self.reward.held_out.values()]
            problems = list(dict.fromkeys(  # once each, however many reward functions find it (shapes, shapes_strict)
                line for f in fns for line in prompt_problems(f.fn, prompts)))
            if problems:
                raise ValueError(f"{key}: " + "; ".join(problems))
        if log_probs and self.trainer.window_schedule != "fixed" and self.algo.sde_window_size is None:
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

    @model_validator(mode="after")
    def _check_tree(self):
        if self.algo.tree is not None:
            from omniroll.engine.tree import check_tree

            params = SamplingParams.model_validate(self.sampling_params())
            check_tree(self.algo.tree, params, self.n, "algo.tree")
            if self.trainer is not None:
                check_tree_training(self.trainer, self.reward, params)  # what a tree-trained algorithm needs
        return self

    def evaluation_guidances(self) -> list[float]:
        """The CFG scales `trainer.evaluation` evaluates at (its `guidance_scales`, else the regime the algorithm
        trains first: 1.0, CFG off, then the validation sampling's scale for a CFG-free rollout; the validation
        sampling's scale alone otherwise)."""
        ev = self.trainer.evaluation if self.trainer is not None else None
        if ev is not None and ev.guidance_scales is not None:
            return list(ev.guidance_scales)
        scale = float(self.sampling_params(validate=True)["guidance_scale"])
        tc = self.trainer
        if tc is not None and scale > 1.0 and cfg_free_rollout(tc.algorithm, tc.algorithm_options):
            return [1.0, scale]
        return [scale]

    def sampling_params(self, validate: bool = False) -> dict:
        """The per-request sampling dict (SamplingParams fields)."""
        sp = {**self.pipeline.model_dump(), **self.algo.model_dump(exclude={"same_latent", "tree"}),
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
    return validate_config(with_model_defaults(raw))


def with_model_defaults(raw: dict) -> dict:
    """`raw` laid over the sampling defaults its model states (`omniroll.models.sampling_defaults`: the shapes
    model's 64 x 64 and 12 tokens, say), so a key the user leaves out takes the model's value before the schema's."""
    from omegaconf import OmegaConf

    from omniroll.models import sampling_defaults

    engine = raw.get("engine")
    model = engine.get("model") if isinstance(engine, dict) else None
    try:
        defaults = sampling_defaults(model if isinstance(model, str) else EngineSection.model_fields["model"].default)
    except ValueError as e:
        raise ConfigError(f"engine.model: {e}") from None
    if not defaults:
        return raw
    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(defaults), OmegaConf.create(raw)), resolve=True)


def validate_config(raw: dict) -> OmniRollConfig:
    try:
        return OmniRollConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("invalid config: " + "; ".join(config_messages(e, OmniRollConfig))) from None
