"""Batch-invariant mode, op by op: a row's result is the same bits alone or inside any batch."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omniroll.engine.execution import BatchInvariantMode, _cpu_flash

# (query length, key length, heads, head dim, mask): self- and cross-attention, each of the CPU flash kernel's
# query-block sizes (32 below 192 queries, 64 below 768, 256 above), one head of 512 (a VAE mid-block), and a boolean
# padding mask. The mode runs these batched (the flash kernel); this checks the claim that makes that safe.
SHAPES = [(40, 40, 2, 16, False), (300, 77, 4, 32, False), (800, 800, 2, 64, False), (256, 256, 1, 512, False),
          (200, 141, 2, 32, True)]


@pytest.mark.parametrize("lq, lk, heads, dim, masked", SHAPES)
def test_flash_attention_rows_are_bitwise_equal_alone_and_in_any_batch(lq, lk, heads, dim, masked):
    g = torch.Generator().manual_seed(lq + lk)
    B = 5
    q, k = torch.randn(B, heads, lq, dim, generator=g), torch.randn(B, heads, lk, dim, generator=g)
    v = torch.randn(B, heads, lk, dim, generator=g)
    mask = None
    if masked:  # each sample keeps a different number of keys
        mask = (torch.arange(lk) < torch.tensor([lk - 7 * i for i in range(B)])[:, None])[:, None, None, :]
    assert _cpu_flash(q, k, v, mask)
    with BatchInvariantMode():
        full = F.scaled_dot_product_attention(q, k, v, mask)
        for i in range(B):
            one = F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                                 None if mask is None else mask[i:i + 1])
            assert torch.equal(full[i], one[0]), f"row {i} moved by {(full[i] - one[0]).abs().max().item():.3g}"
        pair = F.scaled_dot_product_attention(q[2:4], k[2:4], v[2:4], None if mask is None else mask[2:4])
        assert torch.equal(full[2:4], pair)


def test_batched_attention_only_on_the_cpu_flash_kernel():
    q = torch.randn(2, 2, 16, 8)
    assert _cpu_flash(q, q, q)
    assert not _cpu_flash(q, q, torch.randn(2, 2, 16, 24))  # a value width unlike the query's: the math kernel
    with sdpa_kernel(SDPBackend.MATH):
        assert not _cpu_flash(q, q, q)
