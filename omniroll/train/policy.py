"""`Policy`: the trainer's model: the same family's denoiser, loaded from the same checkpoint, with a PEFT LoRA or all
of its weights trainable; the KL reference (the base model: the adapter disabled, no second copy for LoRA); saving and
loading (LoRA in PEFT's `save_pretrained` format, loadable with `PeftModel.from_pretrained` onto the diffusers
transformer). The model stays in eval mode (no dropout anywhere): the rollout's engine runs it in eval mode, and a
ratio is exact only if both sides compute the same function. The rows it trains on are `trajectory_batch.py`'s, their
log-probs under it `recompute.py`'s.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from omniroll.engine.config import torch_dtype
from omniroll.models import load_adapter
from omniroll.models.base import DiffusionAdapter, denoiser_experts
from omniroll.train.kl_reference import KLReference


class Policy:
    """mode "lora": a LoRA (rank, alpha, target_modules; default: the family's `lora_target_modules`, its attention
    projections) on the denoiser (on each expert of a two-expert model), B initialised to zero (so the first rollout,
    on the base weights, is on-policy); mode "full": every denoiser weight is trained. dtype: the compute dtype (the
    frozen model is loaded in it; what is trained stays fp32); device: where the denoiser, what is trained and so the
    optimizer's state live (docs/training/gpu.md). kl_reference (with its decay / every): what `reference()` is
    (`omniroll.train.kl_reference`)."""

    def __init__(self, model_path: str, mode: str = "lora", rank: int = 8, alpha: float = 16.0,
                 target_modules: Optional[list[str]] = None, dtype: str = "float32", seed: int = 0,
                 device: str = "cpu", kl_reference: str = "base", kl_reference_decay: float = 0.99,
                 kl_reference_every: int = 10):
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
        self.model_path, self.mode, self.dtype, self.device = model_path, mode, dtype, torch.device(device)
        # 1. The model in the compute dtype, frozen; only the denoiser on the device (the rows carry the conditioning:
        #    the text encoders and the VAE run here only for the renders of `trainer.data_regularizer`).
        self.adapter: DiffusionAdapter = load_frozen(model_path, dtype, self.device)
        self.denoiser = self.adapter.denoiser
        self.experts = denoiser_experts(self.denoiser)  # checkpoint folder -> transformer (two for Wan 2.2 A14B)
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
                for expert in self.experts.values():  # one generator: two experts' A matrices differ
                    expert.add_adapter(self.lora_config)
            for expert in self.experts.values():
                cast_adapter_dtype(expert, "default")  # a bf16 / fp16 base's adapter: fp32 (PEFT's rule)
            self.denoiser.eval()
        else:
            self.lora_config = None
            self.denoiser.float().requires_grad_(True)
            self.adapter.autocast_dtype = None if dtype == "float32" else torch_dtype(dtype)
        # 3. What the KL term pulls towards: the base, or a kept copy of the trained weights (kl_reference.py).
        self.kl_reference = KLReference(kl_reference, self.named_parameters(), kl_reference_decay, kl_reference_every)

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
        """The model the KL term pulls towards (`kl_reference`): the base (LoRA disabled in place; for full
        fine-tuning a frozen copy loaded once), or this model with the kept reference weights swapped in."""
        if not self.kl_reference.is_base:
            with self.kl_reference.swapped(self.named_parameters()):
                yield self.adapter
        elif self.mode == "lora":
            for expert in self.experts.values():
                expert.disable_adapters()
            try:
                yield self.adapter
            finally:
                for expert in self.experts.values():
                    expert.enable_adapters()
        else:
            if self._reference is None:
                self._reference = load_frozen(self.model_path, self.dtype, self.device)
                self._reference.autocast_dtype = self.adapter.autocast_dtype  # the policy's function at step 0
            yield self._reference

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """LoRA: `adapter_config.json` + `adapter_model.safetensors` (PEFT's save_pretrained layout and key names; a
        two-expert model's keys start with the expert's folder); full: `transformer/` (and `transformer_2/`) via
        diffusers' save_pretrained."""
        os.makedirs(path, exist_ok=True)
        if self.mode == "lora":
            from safetensors.torch import save_file

            from omniroll.weights import lora_state_dict

            sd = {f"base_model.model.{k}": v.detach().contiguous() for k, v in lora_state_dict(self.denoiser).items()}
            save_file(sd, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
            self.lora_config.save_pretrained(path)
        else:
            for folder, expert in self.experts.items():
                expert.save_pretrained(os.path.join(path, folder), safe_serialization=True)

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
                for folder, expert in self.experts.items():
                    sd = load_file(os.path.join(path, folder, "diffusion_pytorch_model.safetensors"))
                    own = dict(expert.named_parameters())
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

