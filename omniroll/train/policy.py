"""The policy, the rows it trains on, and their log-probs under it.

`TrajectoryBatch`: the rows of a rollout as the trainer needs them, from an agent-loop `DataBatch` or from engine
`DiffusionOutput`s. Everything a recompute needs travels with the rows (latents, sigmas, noise level, SDE type,
sigma_max, guidance, conditioning, the engine's execution mode): nothing is looked up from a timestep or mirrored from
a config.

The recompute (`recompute_log_probs`): the log-prob of recorded window steps under the current policy, with autograd.
It reproduces the rollout exactly because it runs the rollout's own functions: `adapter.guided_velocity` (CFG rows
stacked, `velocity`, the CFG mix; differentiable, the engine calls it under no_grad), `sde_step` fed with the
trajectory's own sigma, sigma_next, noise level, SDE type and sigma_max, inside `engine.execution.execution_mode`
(batch-invariant kernels with the same block size), read from the trajectory. With the rollout's weights it returns
the rollout's log-probs bitwise, so a PPO ratio is exactly 1 before the first update.

    out = recompute_log_probs(policy_adapter, traj, step=k)   # SDEStepOutput: log_prob [B] (with grad), mean, std

`Policy`: the trainer's model: the same family's denoiser, loaded from the same checkpoint, with a PEFT LoRA or all of
its weights trainable; the KL reference (the base model: the adapter disabled, no second copy for LoRA); saving and
loading (LoRA in PEFT's `save_pretrained` format, loadable with `PeftModel.from_pretrained` onto the diffusers
transformer). The model stays in eval mode (no dropout anywhere): the rollout's engine runs it in eval mode, and a
ratio is exact only if both sides compute the same function.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional, Sequence

import torch

from omniroll.engine.config import torch_dtype
from omniroll.engine.execution import execution_mode
from omniroll.models import load_adapter
from omniroll.models.base import NO_CFG, DiffusionAdapter, is_conditioning
from omniroll.sampling import SDEStepOutput, sde_step
from omniroll.train.rows import rows_to, take_rows


# ------------------------------------------------------------------------------------------------ the rows
#: trajectory tensors every row must carry (DataBatch key -> TrajectoryBatch field)
_REQUIRED = {"all_latents": "latents", "all_timesteps": "timesteps", "sigmas": "sigmas", "sigmas_next": "sigmas_next",
             "noise_level": "noise_level", "sigma_max": "sigma_max", "guidance_scale": "guidance_scale",
             "cfg_scale": "cfg_scale"}


def batch_columns(batch: Any, tensors: list[str], non_tensors: list[str], hint: str) -> tuple[Any, dict]:
    """(batch.batch, batch.non_tensor_batch) of a rollout batch with every named column and no failed row; ValueError
    naming what is missing (`hint`: how such a batch is made) otherwise."""
    td, nt = batch.batch, batch.non_tensor_batch
    keys = set(td.keys())
    missing = [k for k in tensors if k not in keys]
    if missing:
        raise ValueError(f"batch lacks field(s) {missing} ({hint}); has {sorted(keys)}")
    for k in non_tensors:
        if k not in nt:
            raise ValueError(f"batch lacks non_tensor_batch[{k!r}]")
    if "status" in nt and any(s == "failed" for s in nt["status"]):
        raise ValueError("batch has failed rows (status 'failed'); drop them before training")
    return td, nt


def conditioning_columns(td: Any) -> tuple[dict, dict, dict]:
    """(cond, uncond, lengths): a batch's conditioning tensors (`*prompt_embeds`), their negative prompts' where the
    rows use CFG, and the real-token count of every padded one (from its `*_mask`)."""
    keys = set(td.keys())
    cond, uncond, lengths = {}, {}, {}
    for k in sorted(keys):
        if is_conditioning(k):
            cond[k] = td[k]
            if f"{k}_mask" in keys:
                lengths[k] = td[f"{k}_mask"].sum(1)
            neg = f"negative_{k}"
            if neg in keys:
                uncond[k] = td[neg]
                if f"{neg}_mask" in keys:
                    lengths[neg] = td[f"{neg}_mask"].sum(1)
    if not cond:
        raise ValueError(f"batch carries no conditioning (*prompt_embeds) tensors; has {sorted(keys)}")
    return cond, uncond, lengths


@dataclass
class TrajectoryBatch:
    """B rows. latents [B, W+1, ...] fp32 (the state before each window step, then after the last); timesteps, sigmas,
    sigmas_next, log_probs [B, W]; noise_level, sigma_max, guidance_scale [B] (fp32; a distilled-guidance model's
    input); cfg_scale [B] (fp64, the CFG mix's scale, 0: no unconditional row); experts [B, W] (the denoiser of each
    step, multi-expert families only); sde_type: B names; cond / uncond:
    conditioning tensors [B, ...] with `lengths` [B] of real tokens for the padded sequence ones (uncond None when no
    row uses CFG); weight_version: B ints; execution: the engine's mode (`batch_invariant`, `invariant_block_rows`,
    `dtype`), the same for every row."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    log_probs: torch.Tensor
    noise_level: torch.Tensor
    sigma_max: torch.Tensor
    guidance_scale: torch.Tensor
    cfg_scale: torch.Tensor
    sde_type: list[str]
    cond: dict[str, torch.Tensor]
    uncond: Optional[dict[str, torch.Tensor]]
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: Optional[torch.Tensor] = None
    weight_version: list[int] = field(default_factory=list)
    execution: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        """W: recorded window steps per row."""
        return int(self.log_probs.shape[1])

    def rows(self, idx: Sequence[int] | torch.Tensor) -> "TrajectoryBatch":
        """A sub-batch (row order as given)."""
        return take_rows(self, idx)

    def to(self, device: str | torch.device) -> "TrajectoryBatch":
        """The rows on `device` (`rows_to`)."""
        return rows_to(self, device)

    def at_steps(self, steps: torch.Tensor) -> "TrajectoryBatch":
        """The same rows with one window step each (W = 1): row i's step `steps[i]` (DanceGRPO trains a different
        random step per row in one forward)."""
        steps = torch.as_tensor(steps, dtype=torch.long).reshape(-1)
        i = torch.arange(len(self))
        pair = torch.stack([steps, steps + 1], 1)
        return replace(self, latents=self.latents[i[:, None], pair], timesteps=self.timesteps[i, steps][:, None],
                       sigmas=self.sigmas[i, steps][:, None], sigmas_next=self.sigmas_next[i, steps][:, None],
                       log_probs=self.log_probs[i, steps][:, None],
                       experts=self.experts[i, steps][:, None] if self.experts is not None else None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_batch(cls, batch: Any) -> "TrajectoryBatch":
        """From the agent loop's output `DataBatch` (or anything with `.batch` / `.non_tensor_batch`, e.g. verl's
        DataProto). Failed rows must be removed first."""
        td, nt = batch_columns(batch, list(_REQUIRED) + ["rollout_log_probs"], ["sde_type", "execution", "weight_version"],
                               "was it generated with logprobs and an SDE window?")
        vals = {f: td[k] for k, f in _REQUIRED.items()}
        cond, uncond, lengths = conditioning_columns(td)
        return cls(log_probs=td["rollout_log_probs"].float(), sde_type=[str(s) for s in nt["sde_type"]],
                   cond=cond, uncond=uncond or None, lengths=lengths,
                   experts=td["expert_indices"] if "expert_indices" in td.keys() else None,
                   weight_version=[int(v) for v in nt["weight_version"]],
                   execution=one_execution(list(nt["execution"])), **vals)

    @classmethod
    def from_outputs(cls, outputs: Sequence[Any]) -> "TrajectoryBatch":
        """From engine / client `DiffusionOutput`s (completed, with log-probs; one window size and prompt length)."""
        if not outputs:
            raise ValueError("from_outputs needs at least one output")
        bad = [o.request_id for o in outputs if o.stop_reason != "completed" or o.log_probs is None]
        if bad:
            raise ValueError(f"outputs {bad[:8]} are not completed samples with log-probs")
        efs = [o.extra_fields for o in outputs]

        def stack(k):
            return torch.stack([torch.as_tensor(e[k]) for e in efs])

        cond_keys = sorted(k for k in efs[0] if is_conditioning(k) and isinstance(efs[0][k], torch.Tensor))
        cond = {k: stack(k) for k in cond_keys}
        cfg = [all(f"negative_{k}" in e for k in cond_keys) for e in efs]
        uncond = None
        if any(cfg):
            if not all(cfg):
                raise ValueError("outputs mix CFG and non-CFG rows; build one TrajectoryBatch per kind")
            uncond = {k: stack(f"negative_{k}") for k in cond_keys}
        return cls(latents=stack("all_latents"), timesteps=stack("all_timesteps"), sigmas=stack("sigmas"),
                   sigmas_next=stack("sigmas_next"), log_probs=torch.stack([o.log_probs.float() for o in outputs]),
                   noise_level=torch.tensor([float(e["noise_level"]) for e in efs]),
                   sigma_max=torch.tensor([float(e["sigma_max"]) for e in efs]),
                   guidance_scale=torch.tensor([float(e["guidance_scale"]) for e in efs]),
                   cfg_scale=torch.tensor([float(e["cfg_scale"]) for e in efs], dtype=torch.float64),
                   experts=stack("expert_indices") if "expert_indices" in efs[0] else None,
                   sde_type=[str(e["sde_type"]) for e in efs], cond=cond, uncond=uncond,
                   weight_version=[int(e.get("weight_version", 0)) for e in efs],
                   execution=one_execution([e.get("execution") for e in efs]))


def one_execution(values: list) -> dict:
    """The rows' common execution mode (they must agree: one trainer recompute mode per batch)."""
    modes = {tuple(sorted(dict(v).items())) if isinstance(v, dict) else None for v in values}
    if None in modes:
        raise ValueError("some rows carry no 'execution' record (batch_invariant, invariant_block_rows, dtype): "
                         "they come from an engine that does not record it")
    if len(modes) != 1:
        raise ValueError(f"rows were generated under different execution modes {sorted(modes)}; replicas of one "
                         f"rollout must share batch_invariant, invariant_block_rows and dtype")
    return dict(next(iter(modes)))


# -------------------------------------------------------------------------------------------- the recompute
def check_dtype(adapter: DiffusionAdapter, execution: dict) -> None:
    want = execution.get("dtype")
    have = str(adapter.compute_dtype).removeprefix("torch.")
    if want is not None and want != have:
        raise ValueError(f"the policy computes in {have} but the rollout ran in {want}: load the trainer's model in "
                         f"{want} for exact ratios (or pass check_dtype=False to accept the mismatch)")


def trajectory_velocity(adapter: DiffusionAdapter, traj: TrajectoryBatch, latents: torch.Tensor,
                        timesteps: torch.Tensor, step: int = 0) -> torch.Tensor:
    """Velocity after CFG for every row: `adapter.guided_velocity` (the engine's own call) once per (prompt
    lengths, denoiser) group, on the group's conditioning without padding."""
    B = len(traj)
    expert = [int(traj.experts[i, step]) if traj.experts is not None else 0 for i in range(B)]
    key = [tuple(int(traj.lengths[k][i]) for k in sorted(traj.lengths)) + (expert[i],) for i in range(B)]
    out: list[Optional[torch.Tensor]] = [None] * B
    for group in dict.fromkeys(key):
        rows = [i for i in range(B) if key[i] == group]
        scales = [float(traj.cfg_scale[i]) if traj.uncond is not None else NO_CFG for i in rows]
        cfg = [i for i, g in zip(rows, scales) if g != NO_CFG]
        cond = {k: _trim(traj, k, traj.cond[k], rows) for k in traj.cond}
        uncond = {k: _trim(traj, f"negative_{k}", traj.uncond[k], cfg) for k in traj.cond} if cfg else None
        guidance = traj.guidance_scale[rows] if adapter.guidance_kind == "distilled" else None
        v = adapter.guided_velocity(latents[rows], timesteps[rows], cond, uncond, scales, guidance=guidance,
                                    expert=group[-1])
        for j, i in enumerate(rows):
            out[i] = v[j]
    return torch.stack(out)


def _trim(traj: TrajectoryBatch, name: str, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows' conditioning without padding (all rows of a group share their lengths)."""
    t = t[rows]
    if name in traj.lengths and rows:
        t = t[:, : int(traj.lengths[name][rows[0]])]
    return t


def recompute_log_probs(adapter: DiffusionAdapter, traj: TrajectoryBatch, step: int, *,
                        check_dtype_matches: bool = True) -> SDEStepOutput:
    """Score window step `step` (0 <= step < W) of every row under `adapter`'s current weights.

    Runs with autograd when grad is enabled (the trainer's loss), without it under `torch.no_grad()` (e.g. a KL
    reference with the adapter disabled). Returns `sde_step`'s output: `log_prob` [B], `mean`, `std`.
    """
    W = traj.num_steps
    if not 0 <= step < W:
        raise ValueError(f"step must be in [0, {W}) (the recorded window steps), got {step}")
    if check_dtype_matches:
        check_dtype(adapter, traj.execution)
    x = traj.latents[:, step]
    with execution_mode(traj.execution):
        v = trajectory_velocity(adapter, traj, x, traj.timesteps[:, step], step)
    return sde_step(x, v, traj.sigmas[:, step], traj.sigmas_next[:, step], traj.noise_level, traj.sde_type,
                    prev_sample=traj.latents[:, step + 1], sigma_max=traj.sigma_max)


def enable_gradient_checkpointing(denoiser: torch.nn.Module, execution: dict) -> None:
    """diffusers' gradient checkpointing, made exact: a non-reentrant checkpoint whose recompute pass enters the
    engine's execution mode too (the forward pass already runs inside it), so forward values and gradients stay
    bitwise those of a run without checkpointing. (diffusers' default recomputes outside the mode, which changes the
    kernels and makes torch raise CheckpointError.) Off unless a trainer asks for it."""
    from torch.utils.checkpoint import checkpoint

    fn = functools.partial(checkpoint, use_reentrant=False,
                           context_fn=lambda: (contextlib.nullcontext(), execution_mode(execution)))
    denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=fn)


# ----------------------------------------------------------------------------------------------- the policy
class Policy:
    """mode "lora": a LoRA (rank, alpha, target_modules; default: the family's `lora_target_modules`, its attention
    projections) on the denoiser, B initialised to zero (so the first rollout,
    on the base weights, is on-policy); mode "full": every denoiser weight is trained. dtype: the compute dtype (the
    frozen model is loaded in it; what is trained stays fp32); device: where the denoiser, what is trained and so the
    optimizer's state live (docs/training/gpu.md)."""

    def __init__(self, model_path: str, mode: str = "lora", rank: int = 8, alpha: float = 16.0,
                 target_modules: Optional[list[str]] = None, dtype: str = "float32", seed: int = 0,
                 device: str = "cpu"):
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
        self.model_path, self.mode, self.dtype, self.device = model_path, mode, dtype, torch.device(device)
        # 1. The model in the compute dtype, frozen; only the denoiser on the device (the rows carry the conditioning:
        #    the text encoders and the VAE are never run here).
        self.adapter: DiffusionAdapter = load_frozen(model_path, dtype, self.device)
        self.denoiser = self.adapter.denoiser
        self._reference: Optional[DiffusionAdapter] = None
        self._pinned: Optional[list] = None  # `pin_parameters`
        # 2. What is trained, in fp32: a LoRA on the frozen base, or every denoiser weight (fp32 master weights,
        #    computed under autocast in the compute dtype).
        if mode == "lora":
            from peft import LoraConfig
            from peft.tuners.tuners_utils import cast_adapter_dtype

            targets = list(target_modules or self.adapter.lora_target_modules)  # default: the family's choice
            self.lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                          init_lora_weights=True)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.denoiser.add_adapter(self.lora_config)
            cast_adapter_dtype(self.denoiser, "default")  # a bf16 / fp16 base's adapter: fp32 (PEFT's rule)
            self.denoiser.eval()
        else:
            self.lora_config = None
            self.denoiser.float().requires_grad_(True)
            self.adapter.autocast_dtype = None if dtype == "float32" else torch_dtype(dtype)

    # ------------------------------------------------------------------ what is trained and sent
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self._pinned is not None:
            return list(self._pinned)
        return [(n, p) for n, p in self.denoiser.named_parameters() if p.requires_grad]

    def pin_parameters(self) -> None:
        """From now on the trained parameters are the denoiser's current ones: FSDP2 (train/parallel/fsdp.py)
        registers its gathered copies on the module around forwards, and the trained ones are its sharded
        parameters."""
        self._pinned = [(n, p) for n, p in self.denoiser.named_parameters() if p.requires_grad]

    def weights_to_send(self) -> torch.nn.Module:
        """What `WeightSender.send` takes: the denoiser (with LoRA layers it sends only the adapter and its config)."""
        return self.denoiser

    @contextlib.contextmanager
    def reference(self) -> Iterator[DiffusionAdapter]:
        """The base model for the KL term: LoRA disabled in place; for full fine-tuning a frozen copy loaded once."""
        if self.mode == "lora":
            self.denoiser.disable_adapters()
            try:
                yield self.adapter
            finally:
                self.denoiser.enable_adapters()
        else:
            if self._reference is None:
                self._reference = load_frozen(self.model_path, self.dtype, self.device)
                self._reference.autocast_dtype = self.adapter.autocast_dtype  # the policy's function at step 0
            yield self._reference

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """LoRA: `adapter_config.json` + `adapter_model.safetensors` (PEFT's save_pretrained layout and key names);
        full: `transformer/` via diffusers' save_pretrained."""
        os.makedirs(path, exist_ok=True)
        if self.mode == "lora":
            from safetensors.torch import save_file

            from omniroll.weights import lora_state_dict

            sd = {f"base_model.model.{k}": v.detach().contiguous() for k, v in lora_state_dict(self.denoiser).items()}
            save_file(sd, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
            self.lora_config.save_pretrained(path)
        else:
            self.denoiser.save_pretrained(os.path.join(path, "transformer"), safe_serialization=True)

    def load(self, path: str) -> None:
        """Restore weights written by `save` (bit-exact)."""
        from safetensors.torch import load_file

        with torch.no_grad():
            if self.mode == "lora":
                from omniroll.weights import lora_state_dict, normalize_lora_keys

                tensors = normalize_lora_keys(load_file(os.path.join(path, "adapter_model.safetensors")),
                                              self.denoiser)
                live = {k: p for k, p in zip(lora_state_dict(self.denoiser), self._lora_params())}
                if tensors.keys() != live.keys():
                    raise ValueError(f"checkpoint {path} does not match this LoRA config "
                                     f"(missing {sorted(live.keys() - tensors.keys())[:5]}, "
                                     f"extra {sorted(tensors.keys() - live.keys())[:5]})")
                for k, p in live.items():
                    p.copy_(tensors[k])
            else:
                f = os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors")
                sd = load_file(f)
                own = dict(self.denoiser.named_parameters())
                for k, v in sd.items():
                    if k in own:
                        own[k].copy_(v)

    def _lora_params(self) -> list[torch.nn.Parameter]:
        # the same order as lora_state_dict's keys (PEFT walks the module's state dict in order)
        from omniroll.weights import lora_state_dict

        named = dict(self.denoiser.named_parameters())
        out = []
        for k in lora_state_dict(self.denoiser):
            mod, _, suffix = k.rpartition(".")  # "<mod>.lora_A", "weight"
            out.append(named[f"{mod}.default.{suffix}"])
        return out


def load_frozen(model_path: str, dtype: str, device: torch.device) -> DiffusionAdapter:
    """The model at `model_path` in `dtype`, every module frozen and in eval mode, the denoiser on `device` (the other
    modules stay on the CPU)."""
    adapter = load_adapter(model_path, dtype=torch_dtype(dtype))
    for m in adapter.modules().values():
        m.requires_grad_(False)
        m.eval()
    adapter.denoiser.to(device)
    return adapter


def describe(policy: Policy) -> dict:
    from omniroll.weights import peft_config_to_dict

    n = sum(p.numel() for p in policy.parameters())
    return {"mode": policy.mode, "trainable_parameters": n,
            "lora": peft_config_to_dict(policy.lora_config) if policy.lora_config is not None else None}
