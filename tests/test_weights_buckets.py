import numpy as np
import pytest
import torch

from omniroll.weights import Bucket, WeightManifest, WeightSyncError, pack_buckets, plan_buckets, unpack_bucket
from omniroll.weights.buckets import ALIGN


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.fp32", torch.randn(3, 5, generator=g)),
        ("b.bf16", torch.randn(7, 9, generator=g).to(torch.bfloat16)),
        ("c.fp16", torch.randn(11, generator=g).to(torch.float16)),
        ("d.big", torch.randn(64, 64, generator=g)),  # 16 KiB > bucket
        ("e.scalar", torch.tensor(3.5)),
        ("f.int", torch.arange(10, dtype=torch.int64)),
        ("g.bool", torch.tensor([True, False, True])),
        ("h.empty", torch.empty(0, 4)),
        ("i.noncontig", torch.randn(6, 4, generator=g).t()),
    ]


def test_round_trip_mixed_dtypes_and_oversized_tensor():
    named = _mixed()
    buckets = list(pack_buckets(iter(named), bucket_bytes=1024))
    assert all(isinstance(b.buffer, np.ndarray) and b.buffer.dtype == np.uint8 for b in buckets)
    big = [b for b in buckets if "d.big" in b.names]
    assert len(big) == 1 and big[0].names == ["d.big"] and big[0].buffer.nbytes == 64 * 64 * 4
    assert all(b.buffer.nbytes <= 1024 for b in buckets if b is not big[0])
    out = [kv for b in buckets for kv in unpack_bucket(b)]
    assert [n for n, _ in out] == [n for n, _ in named]
    for (n, src), (_, dst) in zip(named, out):
        assert dst.dtype == src.dtype and dst.shape == src.shape, n
        assert torch.equal(dst, src), n
    for b in buckets:
        assert all(e.offset % ALIGN == 0 for e in b.entries)


def test_unpack_is_zero_copy_and_plan_matches_pack():
    named = _mixed()
    manifest = WeightManifest.from_named_tensors(named)
    buckets = list(pack_buckets(named, bucket_bytes=1024))
    assert plan_buckets(manifest, 1024) == [b.entries for b in buckets]
    b = buckets[0]
    name, view = unpack_bucket(b)[0]
    b.buffer[b.entries[0].offset : b.entries[0].offset + 4] = np.frombuffer(np.float32(42.0).tobytes(), np.uint8)
    assert view.flatten()[0].item() == 42.0
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for _, t in named)


def test_read_only_buffer_and_errors():
    buckets = list(pack_buckets([("x", torch.ones(4, dtype=torch.bfloat16))], 1 << 20))
    ro = buckets[0].buffer.copy()
    ro.setflags(write=False)
    ((_, t),) = unpack_bucket(Bucket(ro, buckets[0].entries))
    assert torch.equal(t, torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(WeightSyncError, match="x"):
        unpack_bucket(Bucket(np.zeros(2, np.uint8), buckets[0].entries))
    with pytest.raises(WeightSyncError, match="complex"):
        list(pack_buckets([("z", torch.zeros(2, dtype=torch.complex64))], 64))
    with pytest.raises(ValueError):
        list(pack_buckets([], 0))


def test_by_reference_buckets_share_the_senders_tensors():
    named = _mixed()
    ref = list(pack_buckets(iter(named), bucket_bytes=1024, by_reference=True))
    copied = list(pack_buckets(iter(named), bucket_bytes=1024))
    assert [b.entries for b in ref] == [b.entries for b in copied]  # the same layout and manifest checks apply
    out = [kv for b in ref for kv in unpack_bucket(b)]
    assert all(b.buffer.nbytes == 0 for b in ref)  # no staging memory
    for (n, src), (m, dst) in zip(named, out):
        assert n == m and dst.data_ptr() == src.data_ptr() and torch.equal(dst, src)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_batched_finite_check_names_exactly_the_tensors_with_a_nan_or_an_inf(bad):
    """`nonfinite` checks all tensors at once (small ones concatenated, one total per dtype) and only then tensor by
    tensor: every position it returns holds a NaN / Inf, whatever the dtype, size or layout, and finite values whose
    sum or sum of squares overflows are not reported."""
    from omniroll.weights.buckets import SMALL_TENSOR, nonfinite

    g = torch.Generator().manual_seed(1)
    tensors = [t for _, t in _mixed()] + [torch.randn(SMALL_TENSOR + 3, generator=g),  # a large fp32 tensor
                                          torch.full((8,), 3e38),  # finite, its sum of squares overflows
                                          torch.full((4,), 6e4, dtype=torch.float16)]  # finite, its sum overflows
    assert nonfinite(tensors) == []

    def spoiled(positions):
        out = [t.clone() for t in tensors]
        for i in positions:
            out[i][tuple(s - 1 for s in out[i].shape)] = bad  # the last element (a 0-dim tensor's only one)
        return out

    floating = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.numel() > 0]
    assert len(floating) == 9
    for i in floating:
        assert nonfinite(spoiled([i])) == [i], (i, tensors[i].dtype, tuple(tensors[i].shape))
    assert nonfinite(spoiled([floating[0], floating[-1]])) == [floating[0], floating[-1]]
