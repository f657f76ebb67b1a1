"""The rollout sections of the YAML config (`replicas`, `engine`, `pipeline`, `algo`, `val_kwargs`, `agent`,
`reward`) and the pieces every section shares (`ConfigError`, the strict base, placement and resources).
`omniroll.config` puts them together with the trainer section; import them from there."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from omniroll.engine.params import (DtypeName, Fps, GuidanceScale, NoiseLevel, NumFrames, OutputType, Pixels, SdeType,
                                    SequenceLength, Steps, TrueCfgScale, WindowRange, WindowSize)
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
    model: str = Field("tiny", min_length=1, description='a diffusers checkpoint path, "shapes" (shipped) or "tiny" '
                                                         '(built on demand)')
    max_batch_size: Union[Literal["auto"], int] = Field(
        16, description='forward rows per batch key; "auto": measured per shape (omniroll.engine.calibrate)')
    device: str = "cpu"
    dtype: DtypeName = "float32"
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

        if value not in TINY_MODELS:  # the shipped models and directories: checked, nothing built
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


class PartialPipeline(_Strict):
    """`val_kwargs.pipeline`: the pipeline fields validation overrides (None: the training value)."""

    height: Optional[Pixels] = None
    width: Optional[Pixels] = None
    num_frames: Optional[NumFrames] = None
    num_inference_steps: Optional[Steps] = None
    guidance_scale: Optional[GuidanceScale] = None
    max_sequence_length: Optional[SequenceLength] = None


class PartialAlgo(_Strict):
    """`val_kwargs.algo`: the sampling fields validation overrides (noise_level 0 by default: the ODE)."""

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
    pipeline: PartialPipeline = Field(default_factory=PartialPipeline)
    algo: PartialAlgo = Field(default_factory=PartialAlgo)


class AgentSection(_Strict):
    num_workers: int = Field(2, ge=1, le=1024)
    default_agent_loop: str = Field("diffusion_single_turn_agent", min_length=1, description="a registered agent loop "
                                    "(checked by RolloutCluster before Ray starts: the registry is the agent loop's)")
    on_failure: Literal["raise", "mark"] = Field(
        "raise", description="raise: one error listing failed rows; mark: return them with status 'failed'"
    )
    placement: Placement = "pack"
    resources: Resources = Field(default_factory=dict)


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
