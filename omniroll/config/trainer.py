"""`trainer:`, the reference Flow-GRPO trainer's section of the YAML config (`omniroll train`): optimisation,
asynchronous training and experiment tracking. `omniroll.config` puts it together with the rollout sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from omniroll.config.algorithms import ALGORITHMS, AlgorithmName, algorithm_choices
from omniroll.config.sections import Placement, Resources, _Strict
from omniroll.engine.params import DtypeName


class LoRASection(_Strict):
    rank: int = Field(8, ge=1, le=4096, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, le=1e6, description="LoRA alpha (the update is scaled by alpha / r)")
    target_modules: Optional[list[str]] = Field(None, min_length=1, description="module names (PEFT target_modules); "
                                                "None: the family's default (its attention projections)")


class EvaluationSection(_Strict):
    """`trainer.evaluation`: a task evaluation before the first step, every `val_every` steps and after the last
    (`omniroll.train.report.task_eval`), beside the validation grids."""

    task: Literal["shapes", "moving_shapes"] = Field(
        "shapes", description="shapes: GenEval's strict accuracy per category on the shapes world (omniroll eval); "
                              "moving_shapes: the same on the moving-shapes world's clips, for a shapes-video "
                              "checkpoint (it must be the model's own task: its omniroll_defaults.json)")
    splits: list[str] = Field(default_factory=lambda: ["train", "heldout"], min_length=1,
                              description="each a split of the task's prompts (train, heldout, all) or a file of "
                                          "prompts, one a line")
    seeds: int = Field(16, ge=1, le=1000, description="pictures per prompt (fixed seeds, the ODE); 16 gives the "
                       "demo's 37 training prompts a standard error of about 2 points")
    beside_seeds: Optional[int] = Field(None, ge=1, le=1000, description="pictures per prompt at the guidance "
                                        "scales after the first (the numbers beside the regime's own); None: "
                                        "seeds")
    guidance_scales: Optional[list[float]] = Field(None, min_length=1, description="the CFG scale of each "
                                                   "evaluation (every split is evaluated at each; <= 1: CFG off); "
                                                   "None: the regime the algorithm trains, first: CFG off (1.0) "
                                                   "then the validation sampling's scale for a CFG-free rollout "
                                                   "(nft, awm), the validation sampling's scale alone otherwise")
    cache: bool = Field(True, description="read the evaluation before training from $OMNIROLL_CACHE_DIR/evaluations "
                        "when the same weights, sampling and seeds drew it before and 8 of its pictures, drawn "
                        "again, are bitwise equal or, drawn by another CPU, have the same verdicts (batch-invariant "
                        "replicas only); else draw it and keep it there "
                        "(omniroll.evaluation.cache); false: always draw")

    @field_validator("splits")
    @classmethod
    def _known_splits(cls, value, info: ValidationInfo):
        """Each a split or a file of the task's world (`task` is checked first: its field comes before)."""
        if info.data.get("task") == "moving_shapes":
            from omniroll.tasks.moving_shapes.splits import prompts_of
        else:
            from omniroll.tasks.shapes.splits import prompts_of

        if len(set(value)) != len(value):
            raise ValueError(f"names a split twice: {value}")
        for split in value:
            try:
                prompts_of(split)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(str(e).splitlines()[0]) from None
        return value

    @field_validator("guidance_scales")
    @classmethod
    def _guidance_scales(cls, value):
        if value is not None:
            bad = [g for g in value if not 0 <= g <= 100]
            if bad:
                raise ValueError(f"each must be in [0, 100], got {bad[0]}")
            if len(set(value)) != len(value):
                raise ValueError(f"names a scale twice: {value}")
        return value


class SignalCheckSection(_Strict):
    """`trainer.signal_check`: whether the batches still carry a GRPO learning signal
    (omniroll.train.report.signal_check). A group is tied when all its rewards are equal: its advantages are 0 and it
    teaches nothing."""

    tied_warn_frac: float = Field(0.75, gt=0, le=1, description="warn (once, until it falls back below) when at "
                                  "least this share of a step's prompt groups is tied, in (0, 1]")
    stop_after_tied_steps: int = Field(5, ge=0, le=10**6, description="stop the run (checkpoint of the last step, "
                                       "then NoLearningSignal; the CLI exits 1) when every group has been tied for "
                                       "this many consecutive steps; 0: never stop")
    reward_window: int = Field(5, ge=1, le=10**4, description="steps averaged at the run's start and at its end by "
                               "the reward-drop warning")
    reward_drop_stds: float = Field(3.0, gt=0, le=1e6, description="warn (once, until it recovers) when the mean "
                                    "reward of the last reward_window steps is more than this many standard errors "
                                    "(from the step rewards' spread) below the mean reward of the first "
                                    "reward_window steps")
    grad_cos_window: int = Field(5, ge=2, le=10**4, description="readings of the gradient-signal meter (grad_cos) "
                                 "the noise warning averages")
    grad_cos_warn: float = Field(0.05, gt=-1, lt=1, description="warn (once, until the window's mean itself "
                                 "reaches this again) when the mean grad_cos of the last grad_cos_window readings "
                                 "plus twice its standard error is below this: the halves of a step's update do not "
                                 "agree, the update is noise")


class KLGateSection(_Strict):
    """GARDO's gate on the KL term (omniroll/train/kl_gate.py): the KL applies only to the `share` of the step's
    samples that the trained reward rates furthest above where the `against` reward functions rate them."""

    against: list[str] = Field(min_length=1, description="reward.functions names whose ranks the trained reward is "
                                                         "checked against (usually at weight 0: judged, not trained)")
    share: float = Field(0.1, gt=0, le=1, description="the share of the step's samples the KL may apply to, in (0, 1] "
                                                      "(GARDO's about 10 %); with adaptive: the first step's")
    adaptive: bool = Field(False, description="GARDO's adaptive share: grows 10 % when the step's mean disagreement "
                                              "exceeds the last 20 steps', shrinks 10 % when below them all")
    share_min: float = Field(0.02, gt=0, le=1, description="adaptive: the least share, in (0, 1] (GARDO's 0.02)")
    share_max: float = Field(0.2, gt=0, le=1, description="adaptive: the largest share, in (0, 1] (GARDO's 0.2)")

    @model_validator(mode="after")
    def _check_bounds(self):
        if self.adaptive and not self.share_min <= self.share <= self.share_max:
            raise ValueError(f"share: with adaptive, share_min <= share <= share_max, got {self.share_min} / "
                             f"{self.share} / {self.share_max}")
        return self


class DataRegularizerSection(_Strict):
    """DDRL's idea (omniroll/train/data_regularizer.py): the flow-matching loss on the task world's own renders of the
    training prompts, added to every optimizer step at `weight`: a pull toward the data, not toward a reference."""

    weight: float = Field(gt=0, le=1e6, allow_inf_nan=False, description="the loss's weight beside the algorithm's, "
                                                                         "in (0, 1e6]")
    batch: int = Field(4, ge=1, le=1024, description="renders per optimizer step, in [1, 1024]")


class RankResources(_Strict):
    """`trainer.resources`: what each trainer rank (a Ray actor of the data-parallel update) reserves."""

    num_cpus: float = Field(1.0, ge=0, le=1024, allow_inf_nan=False, description="CPUs per rank, in [0, 1024]")
    num_gpus: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="GPUs per rank, in [0, 1] (a rank "
                            "drives one GPU at most)")
    custom: Resources = Field(default_factory=dict, description="custom Ray resources per rank, e.g. "
                              "{a100_node: 1} (each > 0)")


#: `trainer.logger` backends (omniroll.train.report.tracking; the last four are optional extras)
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow")


class TrainerSection(_Strict):
    """The trainer (`omniroll train`). Group size is the top-level `n`; sampling comes from `pipeline` / `algo`;
    rewards from `reward`; validation images from `val_kwargs` (ODE). `algorithm` picks the objective
    (omniroll/train/algorithms/); omniroll/config/algorithms.py says which keys each one reads."""

    algorithm: AlgorithmName = Field("flow_grpo", description=algorithm_choices())
    algorithm_options: dict[str, Any] = Field(default_factory=dict, description="the chosen algorithm's own options "
                                              "(omniroll/config/algorithms.py), with its reference defaults")
    steps: int = Field(20, ge=1, le=10**7, description="training steps (--steps overrides it)")
    prompts: list[str] = Field(default_factory=list, description="training prompts (or prompts_file)")
    prompts_file: Optional[str] = Field(None, description="one prompt per line, added to prompts")
    val_prompts: list[str] = Field(default_factory=list, description="fixed validation prompts (default: the "
                                                                     "first 4 training prompts)")
    prompts_per_step: int = Field(4, ge=1, le=100_000, description="prompt groups per step (each of n samples)")
    lr: float = Field(1e-3, gt=0, le=10, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    clip_range: float = Field(1e-4, gt=0, le=10, description="PPO clip epsilon")
    adv_clip_max: float = Field(5.0, gt=0, le=1e6, description="advantages are clipped to [-adv_clip_max, "
                                "adv_clip_max]")
    global_std: bool = Field(False, description="normalise advantages by the whole batch's std, not the group's")
    kl_beta: float = Field(0.0, ge=0, le=1e6, description="the KL term's weight (to trainer.kl_reference)")
    kl_reference: Literal["base", "ema", "reset"] = Field(
        "base", description="what the KL term pulls towards: the base model (LoRA: adapter disabled), an EMA of the "
                            "trained weights (AWM's; kl_reference_decay) or the trained weights at the last multiple "
                            "of kl_reference_every steps (GARDO's reset) (omniroll/train/kl_reference.py)")
    kl_reference_decay: float = Field(0.99, gt=0, lt=1, description="kl_reference ema: the EMA's decay per step, in "
                                                                      "(0, 1)")
    kl_reference_every: int = Field(10, ge=1, description="kl_reference reset: steps between resets, >= 1")
    kl_gate: Optional[KLGateSection] = Field(None, description="GARDO's gate: the KL only on the samples the trained "
                                             "reward rates furthest above the `against` functions (None: on every "
                                             "sample)")
    diversity_bonus: bool = Field(False, description="GARDO's diversity-aware advantages: a positive advantage times "
                                  "the sample's distance to its group's nearest other sample over the group's mean "
                                  "distance (omniroll/train/diversity.py)")
    data_regularizer: Optional[DataRegularizerSection] = Field(
        None, description="DDRL's data regulariser: the flow-matching loss on the task world's renders of the training "
                          "prompts at a weight (None: off)")
    num_inner_epochs: int = Field(1, ge=1, le=1000, description="passes over the step's samples")
    micro_batch_size: int = Field(8, ge=1, le=100_000, description="samples per forward")
    micro_batches_per_update: Optional[int] = Field(None, ge=1, description="gradient accumulation: micro-batches "
                                                    "per optimizer step; None: one step per inner epoch")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient norm clipping")
    mode: Literal["lora", "full"] = Field("lora", description="train a LoRA adapter (trainer.lora) or every weight "
                                          "of the denoiser")
    lora: LoRASection = Field(default_factory=LoRASection, description="the LoRA adapter (mode: lora)")
    window_schedule: Literal["fixed", "random", "progressive"] = Field(
        "fixed", description="MixGRPO's SDE window per step: fixed (algo.sde_window_*), random (from seed and step), "
                             "progressive (MixGRPO's sliding window: starts at the range's start, advances by one "
                             "step every window_advance_every steps, rolls back at the range's end)")
    window_advance_every: int = Field(1, ge=1, description="MixGRPO's iters_per_group (25 in its reference)")
    gradient_checkpointing: Optional[bool] = Field(None, description="recompute activations in the backward pass "
                                                   "(inside the engine's execution mode: values stay bitwise); None: "
                                                   "on when the trainer computes on a GPU (trainer.device), off on the "
                                                   "CPU")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints (0: only the final one)")
    val_every: int = Field(0, ge=0, description="steps between validations (grids, and the task evaluation when "
                                                "`evaluation` is set; 0: before and after only)")
    evaluation: Optional[EvaluationSection] = Field(None, description="a task evaluation (GenEval on the shapes "
                                                                      "world) at every validation; None: none")
    seed: int = Field(0, ge=0, description="trainer seed: prompt order, shuffling, adapter init")
    weight_transport: Literal["auto", "object_store", "ray", "shm"] = Field(
        "auto", description="auto: /dev/shm for replicas on the trainer's node, the Ray object store for the others")
    sync_timeout_s: float = Field(600.0, gt=0, description="deadline of a weight sync (every replica's ack)")
    num_threads: Optional[int] = Field(None, ge=1, le=1024, description="torch threads of the trainer process "
                                       "(None: torch's default); 1 is far faster on a busy small CPU")
    # asynchronous training (docs/training/async.md; omniroll/train/async_rollout.py, update.py)
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
    # the data-parallel update (docs/training/data_parallel.md; omniroll/train/parallel/distributed.py)
    world_size: int = Field(1, ge=1, le=1024, description="trainer ranks that run each step's update, in [1, 1024] "
                            "and <= prompts_per_step (a rank trains whole prompt groups); 1: the update runs in the "
                            "trainer's own process, as always; N > 1: N Ray actors in one torch.distributed group")
    resources: RankResources = Field(default_factory=RankResources, description="what each rank reserves "
                                     "(world_size > 1 only)")
    placement: Placement = Field("pack", description="pack: ranks together; spread: on distinct nodes when it can "
                                 "(world_size > 1 only)")
    # the trainer's device (docs/training/gpu.md; omniroll/config/device.py)
    device: Optional[str] = Field(None, description="where the policy, its gradients and its optimizer state live: "
                                  "cpu, cuda or cuda:N; None: engine.device. With world_size > 1 every rank uses the "
                                  "GPU Ray reserved for it (cuda, with resources.num_gpus: 1)")
    dtype: Optional[DtypeName] = Field(None, description="the frozen base's dtype and the forward's compute dtype "
                                       "(float32, bfloat16, float16); trainable weights and optimizer state stay "
                                       "float32; None: engine.dtype, which it must equal (the recompute computes what "
                                       "the rollout computed)")
    sharding: Literal["replicated", "fsdp"] = Field("replicated", description="replicated: every rank holds the "
                                                    "whole model, its gradients and its optimizer state; fsdp "
                                                    "(mode full, world_size > 1): FSDP2's fully_shard shards the "
                                                    "optimizer state and reduce-scatters the gradients")
    # what a step reports about itself (omniroll/train/report/policy_move.py, signal_check.py)
    policy_move_rows: int = Field(8, ge=0, le=100_000, description="rows (the step's first ones) whose transitions "
                                  "are recomputed before and after the update to measure policy_kl, post_approx_kl "
                                  "and post_clip_frac; 0: not measured")
    signal_check: SignalCheckSection = Field(default_factory=SignalCheckSection, description="warnings and the "
                                             "stop on tied groups, a falling reward or a gradient that is noise")
    signal_every: int = Field(1, ge=0, le=10**6, description="steps between readings of the gradient-signal meter "
                              "(grad_cos: the cosine between the gradients of two halves of the step's prompt "
                              "groups; one extra copy of the trainable gradients; omniroll/train/grad_signal.py); "
                              "0: never")
    signal_components: bool = Field(False, description="at every reading of the gradient-signal meter, the cosine "
                                    "between each reward function's own update direction (its advantages alone, "
                                    "normalised as reward.aggregation does) and the total's, and the share of "
                                    "readings where it is negative (signal/component/<name>/cos_total, neg_share; "
                                    "omniroll/train/component_signal.py); costs one more forward and backward per "
                                    "function and one with zero advantages on the first accumulation group; needs "
                                    "signal_every >= 1 and two reward functions of nonzero weight")
    # experiment tracking (verl's key names; omniroll.train.report.tracking)
    logger: list[str] = Field(default_factory=lambda: ["console", "jsonl"], description="any of console, jsonl, "
                              "tensorboard, wandb, swanlab, mlflow (the last four: optional extras)")
    project_name: str = Field("omniroll", min_length=1, description="wandb / swanlab project, mlflow experiment")
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

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data):
        """The chosen algorithm's reference defaults of shared keys the config leaves unset."""
        if isinstance(data, dict) and data.get("algorithm") in ALGORITHMS:
            data = {**ALGORITHMS[data["algorithm"]].defaults, **data}
        return data

    def options(self):
        """`algorithm_options`, validated by the algorithm's options model (its reference defaults filled in)."""
        return ALGORITHMS[self.algorithm].options.model_validate(self.algorithm_options)

    @model_validator(mode="after")
    def _check(self):
        try:
            self.options()
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(map(str, err["loc"]))
            raise ValueError(f"algorithm_options.{loc}: {err['msg']} (trainer.algorithm {self.algorithm})") from None
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ValueError(f"prompts_file: file not found: {self.prompts_file}")
        n = len(self.all_prompts())
        if n == 0:
            raise ValueError("prompts: training needs at least one prompt (prompts or prompts_file)")
        if self.prompts_per_step > n:
            raise ValueError(f"prompts_per_step: must be <= the number of prompts ({n}), got {self.prompts_per_step}")
        if self.signal_components and self.signal_every == 0:
            raise ValueError("signal_components: the meter per component reads with the gradient-signal meter; set "
                             "signal_every >= 1 (got 0: never)")
        if self.kl_reference != "base" and self.kl_beta == 0:
            raise ValueError(f"kl_reference: {self.kl_reference!r} is what the KL term pulls towards, and kl_beta 0 "
                             f"means no KL term: set kl_beta > 0")
        if self.kl_gate is not None and self.kl_beta == 0:
            raise ValueError("kl_gate: gates the KL term, and kl_beta 0 means no KL term: set kl_beta > 0")
        if self.kl_gate is not None and self.world_size > 1:
            raise ValueError(f"kl_gate: the gate is computed over the step's whole batch by the trainer's own "
                             f"process, so use it with world_size 1 (got {self.world_size})")
        if self.data_regularizer is not None and self.world_size > 1:
            raise ValueError(f"data_regularizer: its renders are drawn by the trainer's own process, so use it with "
                             f"world_size 1 (got {self.world_size})")
        if self.kl_reference != "base" and self.world_size > 1:
            raise ValueError(f"kl_reference: {self.kl_reference!r} is kept by the trainer's own process, so use it "
                             f"with world_size 1 (got {self.world_size})")
        if self.world_size > self.prompts_per_step:
            raise ValueError(f"world_size: must be in [1, prompts_per_step={self.prompts_per_step}] (each rank trains "
                             f"whole prompt groups), got {self.world_size}")
        return self
