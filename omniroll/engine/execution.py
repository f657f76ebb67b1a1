"""The execution mode every model call runs in: `execution_mode(execution)` (from an engine's `execution_info`, recorded
in every trajectory) enters `BatchInvariantMode` when the engine is batch-invariant. The engine's runner and the
trainer's recompute both enter it through this function, so their kernels are the same.

Batch-invariant execution: a request's output must not depend on what else shares its forward.
Measured on this CPU: the tiny SD3 transformer's output for one row moves by ~5e-7 when the batch grows, because
the GEMM kernel (its blocking and reduction order) changes with the number of rows M. Scaled-dot-product attention,
LayerNorm and the element-wise ops are already row-independent. Padding the rows of every `F.linear` to a multiple of
a fixed block (64) keeps the GEMM on the same code path for every row, so each output row is bitwise identical for
any batch size and position (tested), at a small cost (measured in benchmarks/rollout_throughput.py).
Convolutions (oneDNN picks its algorithm by batch size) and GroupNorm (its reduction is split over batch x groups) are
not row-independent: they run one sample at a time, so every sample takes the batch-1 path. Attention runs batched
where SDPA picks its CPU flash kernel (`torch._fused_sdp_choice`), which splits the work into (sample, head, query
block) tiles whose size depends on the sequence lengths only, so a row's result cannot depend on the batch (tested
against one-at-a-time at several shapes); any other kernel (the math fallback, e.g. for a value width unlike the
query's, which runs batched GEMMs) runs one sample at a time. Per-sample attention cost ~17% more than batched in
the bench SD3 transformer's forward (83 vs 97 ms of ~395, profiled).

Element-wise transcendental activations (SiLU, GELU, sigmoid, tanh) have a vectorized kernel and a scalar one for
the tail of a buffer that does not fill a vector pair, and the two round differently (measured: ~7e-9 in Qwen-Image's
48-wide timestep embedding, whose row is a tail alone and vectorized inside a batch). They run on a buffer padded to
a multiple of 64 elements, so every element takes the vectorized path whatever the batch.

Implemented as a `TorchFunctionMode` active around the forward: no library code is patched.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode


#: ops that run one sample at a time -> the input rank at which dim 0 is the batch (None: any rank >= 2).
_PER_SAMPLE = {F.conv1d: 3, F.conv2d: 4, F.conv3d: 5, F.conv_transpose2d: 4, F.group_norm: None}
#: element-wise ops whose vectorized and scalar-tail kernels round differently.
_ELEMENTWISE = {F.silu, F.gelu, F.mish, torch.sigmoid, torch.tanh, torch.Tensor.sigmoid, torch.Tensor.tanh}
_VECTOR_ELEMENTS = 64
_FLASH = SDPBackend.FLASH_ATTENTION.value


def execution_mode(execution: dict):
    """The context every model call runs in, from an engine's `execution_info` (recorded in each trajectory as
    `extra_fields["execution"]`): batch-invariant kernels with its block size when on, else nothing. The engine's
    runner and the trainer's recompute both enter it through this function."""
    if execution.get("batch_invariant"):
        return BatchInvariantMode(int(execution["invariant_block_rows"]))
    return contextlib.nullcontext()


class BatchInvariantMode(TorchFunctionMode):
    """Within this mode, `F.linear` pads its flattened rows to a multiple of `block_rows` (zero rows, sliced off)."""

    def __init__(self, block_rows: int = 64):
        super().__init__()
        self.block_rows = block_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self._linear(*args, **kwargs)
        if func in _PER_SAMPLE:
            return self._per_sample(func, *args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func in _ELEMENTWISE:
            return self._elementwise(func, *args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _attention(query, key, value, attn_mask=None, *args, **kwargs):
        """Batched on the CPU flash kernel (row-independent by construction), else one sample at a time."""
        B = query.shape[0]
        if query.ndim != 4 or B == 1 or _cpu_flash(query, key, value, attn_mask, *args, **kwargs):
            return F.scaled_dot_product_attention(query, key, value, attn_mask, *args, **kwargs)
        outs = []
        for i in range(B):
            mask = attn_mask[i:i + 1] if attn_mask is not None and attn_mask.shape[0] == B else attn_mask
            outs.append(F.scaled_dot_product_attention(query[i:i + 1], key[i:i + 1], value[i:i + 1], mask,
                                                       *args, **kwargs))
        return torch.cat(outs)

    @staticmethod
    def _elementwise(func, input: torch.Tensor, *args, inplace: bool = False, **kwargs):
        flat = input.reshape(-1)
        pad = (-flat.numel()) % _VECTOR_ELEMENTS
        if pad:
            flat = F.pad(flat, (0, pad))
        out = func(flat, *args, **kwargs)[:input.numel()].reshape(input.shape)
        return input.copy_(out) if inplace else out

    @staticmethod
    def _per_sample(func, input: torch.Tensor, *args, **kwargs):
        batched_ndim = _PER_SAMPLE[func]
        if (batched_ndim is not None and input.ndim != batched_ndim) or input.ndim < 2 or input.shape[0] == 1:
            return func(input, *args, **kwargs)
        return torch.cat([func(x, *args, **kwargs) for x in input.split(1)])

    def _linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if input.ndim < 2:
            return F.linear(input, weight, bias)
        rows = input.reshape(-1, input.shape[-1])
        n = rows.shape[0]
        pad = (-n) % self.block_rows
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        out = F.linear(rows, weight, bias)
        if pad:
            out = out[:n]
        return out.reshape(*input.shape[:-1], out.shape[-1])


def _cpu_flash(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, **kwargs) -> bool:
    """Whether SDPA runs these CPU inputs on its flash kernel (the dispatcher's own choice; False if unsure)."""
    if query.device.type != "cpu":
        return False
    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
    except Exception:  # noqa: BLE001 - an API change or an odd argument: take the per-sample path
        return False
    return choice == _FLASH
