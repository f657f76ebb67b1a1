"""A checkpoint `omniroll train` wrote, applied to an in-process engine for inference: a LoRA checkpoint goes in
through the engine's own `add_lora` (what a replica does with a weight sync), a full one replaces the transformer's
weights before the engine starts. The formats are `omniroll.train.policy.Policy.save`'s."""

from __future__ import annotations

import os

LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")
FULL_FILE = os.path.join("transformer", "diffusion_pytorch_model.safetensors")


def checkpoint_kind(path: str) -> str:
    """"lora" or "full"; ValueError naming what a checkpoint directory should hold."""
    if all(os.path.isfile(os.path.join(path, f)) for f in LORA_FILES):
        return "lora"
    if os.path.isfile(os.path.join(path, FULL_FILE)):
        return "full"
    raise ValueError(f"{path} is not a trainer checkpoint: it holds neither a LoRA ({', '.join(LORA_FILES)}) nor "
                     f"full weights ({FULL_FILE})")


def trained_on(path: str) -> str | None:
    """The model a trainer checkpoint was trained on (`engine.model` in its trainer_state.pt), or None where it does
    not say (a checkpoint from elsewhere, an unreadable state)."""
    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(state_file):
        return None
    import torch

    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - only a hint for an error message
        return None
    model = ((state.get("config") or {}).get("engine") or {}).get("model") if isinstance(state, dict) else None
    return model if isinstance(model, str) else None


def another_model(path: str) -> str:
    """The end of a does-not-fit message: the model the checkpoint was trained on, when it says."""
    model = trained_on(path)
    return f"(trained on {model!r}: --model {model})" if model else "(trained on another model?)"


def load_full_weights(adapter, path: str) -> None:
    """Copy a full checkpoint's transformer weights into `adapter`'s denoiser (before an engine owns it)."""
    import torch
    from safetensors.torch import load_file

    state = load_file(os.path.join(path, FULL_FILE))
    own = dict(adapter.denoiser.named_parameters())
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{path}: the full checkpoint lacks {len(missing)} of the model's weights, e.g. "
                         f"{missing[:3]} {another_model(path)}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"{path}: weight {name} has shape {tuple(state[name].shape)}, the model's is "
                                 f"{tuple(p.shape)} {another_model(path)}")
            p.copy_(state[name])


def add_lora_checkpoint(engine, path: str) -> None:
    """Load a LoRA checkpoint into a running engine as weight version 1; ValueError naming the model it was trained
    on when it does not fit this one."""
    from omniroll.weights import LoRABindError, OmniTensorLoRARequest

    try:
        engine.add_lora(OmniTensorLoRARequest(lora_name=os.path.basename(os.path.normpath(path)), lora_int_id=1,
                                              lora_path=path), version=1)
    except LoRABindError as e:
        raise ValueError(f"{path}: its LoRA does not fit this model {another_model(path)}: "
                         f"{str(e).splitlines()[0][:200]}") from None
