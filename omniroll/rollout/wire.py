"""The wire format a `DiffusionOutput` crosses Ray in (`output_to_wire` / `output_from_wire`), and its tensors'
(`tensor_to_numpy` / `numpy_to_tensor`).

Ray serializes numpy arrays out-of-band (pickle protocol 5, one memcpy into the object store, zero-copy reads), while
torch tensors go through torch's own pickling: a 6 MB trajectory costs ~17 ms as a tensor and ~3 ms as numpy. So
every tensor is turned into a numpy view before it leaves a replica and back into a tensor after it arrives (the
agent loop's `DataBatch` crosses the same way). bfloat16 has no numpy dtype: it travels as its int16 bit pattern and
is viewed back, bit-exact.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from omniroll.engine.output import DiffusionOutput

_BF16 = "__bf16__"


def tensor_to_numpy(t: torch.Tensor) -> Any:
    """A numpy view of a CPU tensor (bf16 as {_BF16: int16 bits}); device tensors are copied to the host first."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return {_BF16: t.contiguous().view(torch.int16).numpy()}
    return t.contiguous().numpy()


def numpy_to_tensor(a: Any) -> torch.Tensor:
    """The inverse of `tensor_to_numpy`. Zero-copy for writable arrays; read-only arrays (Ray's object store hands
    out read-only views of shared memory) are copied, because a tensor that aliases the store could be written to."""
    if isinstance(a, dict) and _BF16 in a:
        return numpy_to_tensor(a[_BF16]).view(torch.bfloat16)
    if not a.flags.writeable:
        a = np.array(a, copy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.from_numpy(a)


def output_to_wire(out: DiffusionOutput) -> dict:
    """DiffusionOutput -> a plain dict whose tensors are numpy arrays (and whose other values are left as they are)."""
    extra: dict[str, Any] = {}
    tensor_keys: list[str] = []
    for k, v in out.extra_fields.items():
        if isinstance(v, torch.Tensor):
            extra[k] = tensor_to_numpy(v)
            tensor_keys.append(k)
        else:
            extra[k] = v
    pixels = out.diffusion_output
    log_probs = out.log_probs
    return {
        "diffusion_output": tensor_to_numpy(pixels) if isinstance(pixels, torch.Tensor) else pixels,
        "log_probs": tensor_to_numpy(log_probs) if isinstance(log_probs, torch.Tensor) else log_probs,
        "stop_reason": out.stop_reason,
        "num_preempted": out.num_preempted,
        "extra_fields": extra,
        "tensor_keys": tensor_keys,
    }


def output_from_wire(wire: dict) -> DiffusionOutput:
    """A dict from `output_to_wire` -> DiffusionOutput with torch tensors where the original had them."""
    if not isinstance(wire, dict) or "diffusion_output" not in wire:
        raise TypeError(f"not a wire-format DiffusionOutput (expected a dict with 'diffusion_output'), got "
                        f"{type(wire)}")
    tensor_keys = set(wire.get("tensor_keys", ()))
    extra = {
        k: (numpy_to_tensor(v) if k in tensor_keys else v) for k, v in wire.get("extra_fields", {}).items()
    }
    pixels = wire["diffusion_output"]
    log_probs = wire.get("log_probs")
    return DiffusionOutput(
        diffusion_output=numpy_to_tensor(pixels) if _is_array(pixels) else pixels,
        log_probs=numpy_to_tensor(log_probs) if _is_array(log_probs) else log_probs,
        stop_reason=wire.get("stop_reason"),
        num_preempted=wire.get("num_preempted"),
        extra_fields=extra,
    )


def _is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or (isinstance(a, dict) and _BF16 in a)
