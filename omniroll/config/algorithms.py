"""`trainer.algorithm` and `trainer.algorithm_options`: what each training algorithm accepts (its options with the
reference defaults, the shared `trainer.*` keys it reads, the rollout it needs). The algorithms' code is in
`omniroll/train/algorithms/` (one file each, named after the algorithm: `trainer.algorithm: nft` is the `Algorithm`
subclass of `omniroll/train/algorithms/nft.py`); this file only declares their configuration, so the config package
stays below the trainer. `ALGORITHMS` is the one list of algorithms: the config's choices, the FSDP ones
(`fsdp_algorithms`), the CLI's help, the trainer's classes and the tests' parametrisations derive from it.

A shared key an algorithm does not read (for example `trainer.clip_range` with `nft`) is an error naming it when it is
set to anything but its default; a shared key whose reference default differs for an algorithm (`global_std`,
`kl_beta`, `clip_range`) takes that default unless it is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from pydantic import Field

from omniroll.config.sections import _Strict


# ------------------------------------------------------------------------------------------ each algorithm's options
class NoOptions(_Strict):
    """Flow-GRPO and GRPO-Guard: every option is a shared `trainer.*` key."""


class DanceGRPOOptions(_Strict):
    timestep_fraction: float = Field(0.6, gt=0, le=1, description="share of each sample's recorded SDE steps trained, "
                                     "drawn per sample (DanceGRPO's timestep_fraction)")


class TreeGRPOOptions(_Strict):
    trained_steps: Literal["all", "forks"] = Field("all", description="which recorded steps of a leaf train: all, "
                                                   "every step from the first fork on (each with the advantage of "
                                                   "the node whose noise it drew); forks, only the fork steps "
                                                   "(pruning: one loss term per fork)")


class ForwardProcessOptions(_Strict):
    """What NFT and AWM share: their rollout's guidance and how their training timesteps are batched."""

    rollout_cfg: bool = Field(False, description="sample with the pipeline's CFG (the reference samples without)")
    timesteps_per_forward: int = Field(1, ge=1, le=1000, description="training timesteps of a micro-batch's rows "
                                       "in one forward (micro_batch_size x this many rows): the same loss, faster "
                                       "on a small model, that much more activation memory")


class NFTOptions(ForwardProcessOptions):
    beta: float = Field(1.0, gt=0, le=100, description="NFT strength: v_pos = beta v + (1 - beta) v_old (1.0 for "
                        "GenEval in the reference; 0.1 for OCR)")
    timestep_fraction: float = Field(0.99, gt=0, le=1, description="share of each sample's sampling timesteps "
                                     "trained, in a random order per sample (int(T * fraction), at least 1)")
    decay_type: Literal[0, 1, 2] = Field(1, description="old-adapter update old <- d old + (1 - d) theta after each "
                                         "step: 0: d = 0 (on-policy); 1: d = min(0.001 step, 0.5); 2: d = 0 before "
                                         "step 75, then min(0.0075 (step - 75), 0.999)")
    adaptive_weight_min: float = Field(1e-5, gt=0, le=1, description="floor of the per-sample adaptive weight "
                                       "mean |x0_pred - x0|")


class AWMOptions(ForwardProcessOptions):
    train_timesteps: int = Field(6, ge=1, le=1000, description="timesteps trained per sample, drawn without "
                                 "replacement from its sampling timesteps after the first")
    weighting: Literal["ghuber", "mse"] = Field("ghuber", description="w(l, t): ghuber (t / p) ((l + e)^p - e^p), "
                                                "or mse (t l)")
    huber_p: float = Field(0.25, gt=0, le=1, description="p of the ghuber weighting")
    huber_eps: float = Field(1e-3, gt=0, le=1, description="e of the ghuber weighting")


class OnlineDPOOptions(ForwardProcessOptions):
    beta: float = Field(1000.0, gt=0, le=1e6, description="Diffusion-DPO's beta: the sharpness of the preference "
                        "loss -log sigmoid(-beta (d_winner - d_loser)) on the velocity errors' differences to the "
                        "reference (not tuned; the reference's 5000 is for SD 1.5's epsilon error)")
    train_timesteps: int = Field(4, ge=1, le=1000, description="timesteps trained per sample, drawn without "
                                 "replacement from its sampling timesteps after the first")


# ------------------------------------------------------------------------------------------------------ the specs
#: shared trainer keys every algorithm reads
COMMON_KEYS = frozenset({
    "steps", "prompts", "prompts_file", "val_prompts", "prompts_per_step", "lr", "weight_decay", "adam_betas",
    "adv_clip_max", "global_std", "kl_beta", "kl_reference", "kl_reference_decay", "kl_reference_every",
    "kl_gate", "data_regularizer", "diversity_bonus",
    "num_inner_epochs", "micro_batch_size", "micro_batches_per_update",
    "max_grad_norm", "mode", "lora", "gradient_checkpointing", "checkpoint_every", "val_every", "evaluation", "seed",
    "weight_transport", "sync_timeout_s", "num_threads", "max_staleness", "partial_rollout", "on_stale",
    "signal_check", "signal_every", "signal_components", "logger", "project_name", "experiment_name",
    "log_images_every", "log_images_count", "algorithm", "algorithm_options", "world_size", "resources", "placement",
    "device", "dtype", "sharding"})
#: shared keys only the log-prob (SDE window) algorithms read
LOG_PROB_KEYS = frozenset({"clip_range", "old_log_prob", "behaviour_weight_cap", "window_schedule",
                           "window_advance_every", "policy_move_rows"})


@dataclass(frozen=True)
class AlgorithmSpec:
    """title: its name as papers and plots write it (e.g. 'Flow-GRPO'). options: its options' model. rollout:
    "sde_window" (latents and log-probs of the SDE window) or "clean_latent" (only the final latent of a deterministic
    ODE, no log-probs). fsdp: whether `trainer.sharding: fsdp` runs it. decoupled: whether its loss with stale samples
    (`trainer.max_staleness` >= 1, or `old_log_prob: recompute`) is the decoupled PPO anchored at the step's proximal
    weights and weighted by pi_prox / pi_behaviour (False: its anchor is the behaviour itself). sde_types: the
    `algo.sde_type` values it accepts (sde_window only). same_latent: whether it needs `algo.same_latent: true`. tree:
    whether it needs a tree rollout (`algo.tree`). defaults: its reference defaults of shared keys. unread: shared keys
    it does not read."""

    title: str
    options: type
    rollout: Literal["sde_window", "clean_latent"]
    fsdp: bool = False
    decoupled: bool = False
    sde_types: tuple[str, ...] = ()
    same_latent: Optional[bool] = None
    tree: bool = False
    defaults: dict = field(default_factory=dict)
    unread: frozenset = frozenset()

    @property
    def keys(self) -> frozenset:
        return (COMMON_KEYS | (LOG_PROB_KEYS if self.rollout == "sde_window" else frozenset())) - self.unread


#: every algorithm, by its `trainer.algorithm` name (its file: omniroll/train/algorithms/<name>.py, whose docstring
#: names its reference). FSDP runs the SDE-window ones: their rows are what its zero-weight micro-batch scores (nft
#: would also keep a second, unsharded copy of the trained weights).
ALGORITHMS: dict[str, AlgorithmSpec] = {
    "flow_grpo": AlgorithmSpec("Flow-GRPO", NoOptions, "sde_window", fsdp=True, decoupled=True,
                               sde_types=("sde", "cps", "dance_sde")),
    "grpo_guard": AlgorithmSpec("GRPO-Guard", NoOptions, "sde_window", fsdp=True, sde_types=("sde",),
                                defaults={"clip_range": 2e-6}),
    "dance_grpo": AlgorithmSpec("DanceGRPO", DanceGRPOOptions, "sde_window", fsdp=True, decoupled=True,
                                sde_types=("dance_sde",), same_latent=True),
    "tree_grpo": AlgorithmSpec("Tree-GRPO", TreeGRPOOptions, "sde_window", fsdp=True, decoupled=True,
                               sde_types=("sde", "cps", "dance_sde"), tree=True,
                               # its advantages are per tree depth (and step), not per reward function
                               unread=frozenset({"global_std", "signal_components"})),
    "nft": AlgorithmSpec("DiffusionNFT", NFTOptions, "clean_latent", defaults={"global_std": True, "kl_beta": 1e-4}),
    "awm": AlgorithmSpec("AWM", AWMOptions, "clean_latent", defaults={"kl_beta": 0.003}),
    "online_dpo": AlgorithmSpec("Online Diffusion-DPO", OnlineDPOOptions, "clean_latent"),
}

#: the `trainer.algorithm` values: the registered algorithms' names
AlgorithmName = Literal[tuple(ALGORITHMS)]  # type: ignore[valid-type]


def algorithms_with(rollout: str) -> list[str]:
    """The registered algorithms whose rollout is `rollout` ("sde_window" or "clean_latent"), in registration order."""
    return [name for name, spec in ALGORITHMS.items() if spec.rollout == rollout]


def fsdp_algorithms() -> list[str]:
    """The algorithms `trainer.sharding: fsdp` runs (`AlgorithmSpec.fsdp`)."""
    return [name for name, spec in ALGORITHMS.items() if spec.fsdp]


def algorithm_choices() -> str:
    """The `trainer.algorithm` values by rollout, for the config's description."""
    return (f"{', '.join(algorithms_with('sde_window'))} (SDE window, log-probs) or "
            f"{', '.join(algorithms_with('clean_latent'))} (forward process: the clean latent of an ODE rollout)")


def cfg_free_rollout(algorithm: str, options: dict) -> bool:
    """Whether `algorithm` with `options` (a `trainer.algorithm_options` dict) rolls out, and so trains, the CFG-free
    policy: the forward-process algorithms unless `rollout_cfg` keeps the pipeline's CFG. Such a run is evaluated
    CFG-free by default."""
    spec = ALGORITHMS.get(algorithm)
    return (spec is not None and spec.rollout == "clean_latent"
            and not spec.options.model_validate(options or {}).rollout_cfg)


#: `algo.*` keys that describe the SDE window: a forward-process algorithm samples the ODE and sets none of them
SDE_ALGO_KEYS = ("noise_level", "sde_type", "sde_window_size", "sde_window_range", "same_latent")


def _changed(section) -> set:
    """The keys of a section set to something other than their default (a config dumped with every key and loaded
    again sets the others to their defaults)."""
    fields = type(section).model_fields
    return {k for k in section.model_fields_set if k in fields and getattr(section, k) != fields[k].get_default(
        call_default_factory=True)}


def check_algorithm(trainer, algo) -> None:
    """The cross-section rules of `trainer.algorithm` (ValueError naming the key): every set shared key is one it
    reads; its SDE type and shared initial noise; a forward-process algorithm leaves the SDE window keys unset, unless
    its group shares noise (a tree, or `same_latent`): then the window is where the members draw their own."""
    spec = ALGORITHMS[trainer.algorithm]
    name = trainer.algorithm
    extra = sorted(k for k in _changed(trainer) if k not in spec.keys)
    if extra:
        why = ("it does not read it" if extra[0] in spec.unread
               else f"its rollout is {spec.rollout.replace('_', ' ')}")
        raise ValueError(f"trainer.{extra[0]} does not apply to trainer.algorithm {name} ({why}); remove it")
    if spec.rollout == "clean_latent":
        set_algo = [k for k in SDE_ALGO_KEYS if k in _changed(algo)]
        shares_noise = algo.tree is not None or algo.same_latent  # its window: where the group's members differ
        if shares_noise and (algo.sde_type == "ode" or algo.noise_level <= 0):
            raise ValueError(f"algo.noise_level: trainer.algorithm {name} on a group that shares its noise "
                             f"(algo.tree or algo.same_latent) samples the SDE window, where the members draw their "
                             f"own noise; set noise_level > 0 and an sde_type, got {algo.sde_type} at "
                             f"{algo.noise_level}")
        if set_algo and not shares_noise:
            raise ValueError(f"algo.{set_algo[0]} does not apply to trainer.algorithm {name}: it samples the "
                             f"deterministic ODE and records no SDE window (unless its group shares noise: algo.tree "
                             f"or algo.same_latent); remove it")
        return
    if algo.sde_type not in spec.sde_types:
        raise ValueError(f"algo.sde_type: trainer.algorithm {name} samples with {' or '.join(spec.sde_types)}, got "
                         f"{algo.sde_type!r}")
    if spec.same_latent is not None and algo.same_latent != spec.same_latent:
        raise ValueError(f"algo.same_latent: trainer.algorithm {name} needs {str(spec.same_latent).lower()} (the "
                         f"samples of a group share their initial noise)")
    if spec.tree and algo.tree is None:
        raise ValueError(f"algo.tree: trainer.algorithm {name} trains the step-level advantages of a tree rollout; "
                         f"set algo.tree: {{fork_steps: [...], widths: [...]}} (docs/training/tree_grpo.md)")


def check_tree_training(trainer, reward, params) -> None:
    """The rules of an algorithm that trains a tree rollout (`AlgorithmSpec.tree`, with `algo.tree` set; `params`: the
    training `SamplingParams`), ValueError naming the key: the node values are mean leaf rewards of the summed reward
    (`reward.aggregation: sum`), and when every step after the first fork trains (`trained_steps: all`), every sample
    has the same SDE window (so every row trains as many steps)."""
    if not ALGORITHMS[trainer.algorithm].tree:
        return
    name = trainer.algorithm
    if reward.aggregation != "sum":
        raise ValueError(f"reward.aggregation: trainer.algorithm {name} credits each tree node with its leaves' mean "
                         f"reward: it needs sum, got {reward.aggregation!r}")
    lo, hi = params.window_range()
    size = params.sde_window_size
    if trainer.options().trained_steps == "all" and size is not None and hi - lo > size:
        raise ValueError(f"algo.sde_window_range: trainer.algorithm {name} with trained_steps all trains every "
                         f"recorded step from the first fork on, so every sample needs the same SDE window: a range "
                         f"of sde_window_size ({size}) steps, got [{lo}, {hi}); or set "
                         f"trainer.algorithm_options.trained_steps: forks")
