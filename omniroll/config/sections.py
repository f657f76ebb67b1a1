"""The rollout sections of the YAML config (`replicas`, `engine`, `pipeline`, `algo`, `val_kwargs`, `agent`,
`reward`) and the pieces every section shares (`ConfigError`, the strict base, placement and resources).
`omniroll.config` puts them together with the trainer section; import them from there."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from omniroll.config.agent_loops import SINGLE_TURN, check_agent_loop
from omniroll.engine.params import (DtypeName, Fps, GuidanceScale, NoiseLevel, NumFrames, OutputType, Pixels, SdeType,
                                    SequenceLength, SolverName, Steps, TrueCfgScale, WindowRange, WindowSize)
from omniroll.engine.tree import TreeSpec
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
    """`replicas`: the rollout replicas, one `DiffusionEngine` per Ray actor, and where Ray places them."""

    count: int = Field(1, ge=1, le=1024, description="rollout replicas: one engine each, in its own Ray actor")
    num_cpus: float = Field(1.0, ge=0, allow_inf_nan=False, description="CPUs Ray reserves per replica")
    num_gpus: float = Field(0.0, ge=0, allow_inf_nan=False, description="GPUs per replica (one replica holds the "
                            "whole pipeline on one device; 0.5 packs two on a GPU)")
    max_concurrency: int = Field(1000, ge=1, description="Ray calls a replica actor runs at once (its "
                                 "requests wait in the engine, not in Ray)")
    placement: Placement = Field("pack", description="pack: replicas together; spread: on distinct nodes when it can")
    resources: Resources = Field(default_factory=dict, description="custom Ray resources each replica needs")
    colocate: bool = Field(False, description="training: the replicas share the trainer's device; the trainer puts "
                           "them to sleep (sleep_level) before each update and wakes them for the weight sync")
    sleep_level: Literal[1, 2] = Field(1, description="a colocated replica's sleep: 1 offloads its weights to host "
                                       "memory; 2 drops the denoiser's weights (trainer.mode full only: the sync "
                                       "sends them all back)")


class EngineSection(_Strict):
    """`engine`: the model every replica loads, its device, dtype and batching."""

    model: str = Field("tiny", min_length=1, description='a diffusers checkpoint path, "shapes" (shipped) or "tiny" '
                                                         '(built on demand)')
    max_batch_size: Union[Literal["auto"], int] = Field(
        16, description='forward rows per batch key; "auto": measured per shape (omniroll.engine.calibrate)')
    device: str = Field("cpu", description="torch device of the model: cpu, cuda, cuda:N")
    dtype: DtypeName = Field("float32", description="weights' and forwards' dtype (the SDE step, latents and "
                                                    "log-probs are fp32 whatever it is)")
    num_threads: Optional[int] = Field(None, ge=1, le=1024, description="torch threads per replica (same on all)")
    max_waiting: int = Field(8192, ge=1, le=1_000_000, description="requests that may wait to start on one replica; "
                             "a call past it is refused (EngineOverloadedError), nothing queued")
    merge_lora: bool = Field(False, description="keep a LoRA adapter merged into the weights: the base model's forward "
                             "cost, samples equal to the unmerged adapter's to rounding, not bitwise (for algorithms "
                             "that take no ratio: nft, awm; and for evaluation)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the other EngineConfig fields "
                                   "(decode_batch_size, weight_update, prefix_sharing, ...: docs/reference/engine.md)")

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
        kw = {"device": self.device, "dtype": self.dtype, "max_batch_size": self.max_batch_size,
              "max_waiting": self.max_waiting, "merge_lora": self.merge_lora, **self.kwargs}
        if self.num_threads is not None:
            kw["num_threads"] = self.num_threads
        return kw


# The sampling sections: each field's type and bounds are `omniroll.engine.params`'s (one declaration per field).
class PipelineSection(_Strict):
    """`pipeline`: what a sample looks like (size, frames, steps, solver, guidance, text length, output)."""

    height: Pixels = Field(512, description="image height in pixels (a multiple of the model's spatial factor)")
    width: Pixels = Field(512, description="image width in pixels")
    num_frames: NumFrames = Field(1, description="1 for images; video models: their rule (Wan: 4k + 1)")
    fps: Fps = Field(16, description="frames per second of written videos")
    num_inference_steps: Steps = Field(10, description="denoising steps")
    solver: SolverName = Field("euler", description="the deterministic steps' solver (every step of an ODE rollout, "
                               "the steps outside the SDE window otherwise): euler, or dpmpp_2m (DPM-Solver++ 2M); "
                               "the window's steps are always the SDE's")
    guidance_scale: GuidanceScale = Field(4.5, description="CFG scale (<= 1: no CFG); FLUX.1: the distilled guidance "
                                                        "given to the model")
    true_cfg_scale: TrueCfgScale = Field(1.0, description="guidance-distilled models (FLUX.1) only")
    max_sequence_length: SequenceLength = Field(128, description="text length in tokens (T5 / the family's text "
                                                               "encoder)")
    output_type: OutputType = Field("pixel", description="what a sample returns: pixels, the final latent, or both")


class AlgoSection(_Strict):
    """`algo`: the stochastic steps RL learns from: noise level, SDE type and the recorded window."""

    noise_level: NoiseLevel = Field(0.7, description="SDE noise level eta of the window steps (0: the ODE)")
    sde_type: SdeType = Field("sde", description="the window steps' sampler: Flow-GRPO's sde, cps (coefficients-"
                                                 "preserving), DanceGRPO's dance_sde, or ode")
    sde_window_size: Optional[WindowSize] = Field(None, description="SDE steps recorded per sample (log-prob and "
                                                  "latents); None: every step but the last")
    sde_window_range: Optional[WindowRange] = Field(None, description="[lo, hi): the window is drawn inside these "
                                                    "steps, per sample from its seed; None: every step")
    same_latent: bool = Field(False, description="training samples of a prompt group share their initial noise and "
                                                 "SDE window (flow_grpo's same_latent); their ODE prefix runs once")
    tree: Optional[TreeSpec] = Field(None, description="tree rollouts: each prompt group is a tree forking at "
                                     "tree.fork_steps into tree.widths children per level, its n leaves sharing the "
                                     "initial noise and each node's steps (computed once); None: independent samples")


_TRAINING_VALUE = "overrides the training value for validation (None: the training value)"


class PartialPipeline(_Strict):
    """`val_kwargs.pipeline`: the pipeline fields validation overrides (None: the training value)."""

    height: Optional[Pixels] = Field(None, description=_TRAINING_VALUE)
    width: Optional[Pixels] = Field(None, description=_TRAINING_VALUE)
    num_frames: Optional[NumFrames] = Field(None, description=_TRAINING_VALUE)
    num_inference_steps: Optional[Steps] = Field(None, description=_TRAINING_VALUE)
    guidance_scale: Optional[GuidanceScale] = Field(None, description="overrides the training value for validation "
                                                    "(None: the regime the algorithm trains: CFG off, 1.0, for NFT "
                                                    "and AWM, which roll out CFG-free; the pipeline's scale else)")
    max_sequence_length: Optional[SequenceLength] = Field(None, description=_TRAINING_VALUE)


class PartialAlgo(_Strict):
    """`val_kwargs.algo`: the sampling fields validation overrides (noise_level 0 by default: the ODE)."""

    noise_level: NoiseLevel = Field(0.0, description="validation's noise level (0: the ODE, fixed pictures per seed)")
    sde_type: Optional[SdeType] = Field(None, description=_TRAINING_VALUE)
    sde_window_size: Optional[WindowSize] = Field(None, description=_TRAINING_VALUE)
    sde_window_range: Optional[WindowRange] = Field(None, description=_TRAINING_VALUE)


class ValKwargs(_Strict):
    """Validation overlay. By default every row gets its own seed derived from `seed`; `seed_mode: shared` gives
    every row the seed `seed` itself (VeRL-Omni's validation semantics: the samples of one prompt are identical)."""

    n: int = Field(1, ge=1, description="validation samples per prompt")
    seed: int = Field(42, ge=0, description="validation seed base (fixed: the same pictures for the same weights)")
    seed_mode: Literal["per_row", "shared"] = Field("per_row", description="per_row: each row's seed derived from "
                                                    "seed; shared: every row gets seed itself")
    pipeline: PartialPipeline = Field(default_factory=PartialPipeline)
    algo: PartialAlgo = Field(default_factory=PartialAlgo)


class AgentSection(_Strict):
    """`agent`: the agent-loop workers that turn a prompt batch into rows and requests."""

    num_workers: int = Field(2, ge=1, le=1024, description="agent-loop worker actors (each runs a chunk of the "
                             "batch)")
    default_agent_loop: str = Field(SINGLE_TURN, min_length=1, description="a registered agent loop (checked when "
                                    "the config loads: import the module that registers your own loop first)")
    on_failure: Literal["raise", "mark"] = Field(
        "raise", description="raise: one error listing failed rows; mark: return them with status 'failed'"
    )
    placement: Placement = Field("pack", description="pack: the workers together; spread: on distinct nodes when "
                                                     "it can")
    resources: Resources = Field(default_factory=dict, description="custom Ray resources each worker needs")

    @field_validator("default_agent_loop")
    @classmethod
    def _check_loop(cls, v: str) -> str:
        return check_agent_loop(v)


class RewardSection(RewardWorkerConfig):
    """The reward workers' own config (`omniroll.reward.RewardConfig`: `functions` of `RewardFunctionConfig`,
    micro-batching knobs) plus how many workers to start; an empty `functions` means no streaming reward."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_workers: int = Field(1, ge=0, le=1024, description="reward worker actors (they score samples as they "
                             "finish)")
    functions: dict[str, RewardFunctionConfig] = Field(default_factory=dict, description="name -> a reward "
                                                         "function; the reward is sum(weight x score) "
                                                         "(reward.aggregation says how it trains)")
    held_out: dict[str, RewardFunctionConfig] = Field(default_factory=dict, description="name -> a reward function "
                                                        "(the form of functions) scored on the validation samples "
                                                        "only, never trained on; logged beside the trained reward, "
                                                        "with a warning when the trained reward rises while one "
                                                        "falls (omniroll/train/report/held_out.py)")
    placement: Placement = Field("pack", description="pack: the workers together; spread: on distinct nodes when "
                                                     "it can")
    resources: Resources = Field(default_factory=dict, description="custom Ray resources each worker needs")

    @field_validator("held_out")
    @classmethod
    def _held_out_names(cls, value, info: ValidationInfo):
        """Names as `functions`' (they key the logs), none also trained."""
        cls._check_names(value)
        both = sorted(set(value) & set(info.data.get("functions") or {}))
        if both:
            raise ValueError(f"{both[0]!r} is also in reward.functions: a held-out function is never trained on "
                             f"(give it another name, or remove it from one of the two)")
        return value

    def worker_config(self) -> dict:
        """What `omniroll.reward.create_reward_workers` takes."""
        return {"functions": dict(self.functions), "max_batch_size": self.max_batch_size,
                "max_wait_ms": self.max_wait_ms, "aggregation": self.aggregation}
