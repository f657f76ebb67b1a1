"""max_batch_size="auto": the engine measures its forward rows per batch key once, caches the choice on disk, and
the choice never changes a sample (batch-invariant mode)."""

import json

import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine import calibrate
from omniroll.engine.engine import DiffusionEngine


def requests(n, height=32, prefix="c"):
    params = SamplingParams(height=height, width=32, num_inference_steps=3, max_sequence_length=16)
    return [GenerationRequest(request_id=f"{prefix}{i}", prompt=f"a cat {i}", seed=i, sampling_params=params)
            for i in range(n)]


def test_auto_rows_are_measured_once_cached_and_change_no_sample(tiny_sd3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIROLL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_memory", {})
    monkeypatch.setattr(calibrate, "_machine_busy", lambda: False)  # (the test machine may be busy: see below)
    auto = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size="auto")
    fixed = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    try:
        outs = auto.generate(requests(6))
        (rows,) = auto.scheduler.key_rows.values()  # one batch key
        assert rows in calibrate.CPU_CANDIDATES
        (key, ms_per_row), = auto.calibrator.measured.items()
        assert set(ms_per_row) == set(calibrate.CPU_CANDIDATES)
        fastest = min(ms_per_row, key=ms_per_row.get)
        assert rows == (fastest if ms_per_row[fastest] <= 0.95 * ms_per_row[16] else 16)
        assert json.loads((tmp_path / "calibration.json").read_text()) == {key: rows}
        assert auto.stats()["mean_rows_per_step"] <= rows
        for a, b in zip(outs, fixed.generate(requests(6))):
            assert torch.equal(a.diffusion_output, b.diffusion_output) and torch.equal(a.log_probs, b.log_probs)
    finally:
        auto.shutdown()
        fixed.shutdown()
    monkeypatch.setattr(calibrate, "_memory", {})  # a new process: the choice comes from disk, nothing is measured
    again = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size="auto")
    try:
        again.generate(requests(1))
        assert again.calibrator.measured == {}
        assert list(again.scheduler.key_rows.values()) == [rows]
    finally:
        again.shutdown()


def test_a_calibration_on_a_busy_machine_is_not_cached(tiny_sd3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIROLL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_memory", {})
    monkeypatch.setattr(calibrate, "_machine_busy", lambda: True)
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size="auto")
    try:
        assert engine.generate(requests(1))[0].stop_reason == "completed"
        assert len(engine.calibrator.measured) == 1 and not (tmp_path / "calibration.json").exists()
    finally:
        engine.shutdown()


def test_invariant_decode_uses_fixed_padded_blocks(tiny_sd3_path):
    """Every VAE call decodes exactly decode_batch_size images (zero-padded), so an image's pixels are the same bits
    alone, with any block mates, at any position and split across blocks."""
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, decode_batch_size=4)
    try:
        shape = engine.adapter.latent_shape(32, 32)
        x = torch.randn((7,) + shape, generator=torch.Generator().manual_seed(0))
        seen = []
        real_decode = engine.adapter.decode
        engine.adapter.decode = lambda z: (seen.append(z.shape[0]), real_decode(z))[1]
        alone = engine.runner.decode(x[3:4])[0]
        for batch, pos in ((x[:4], 3), (x[1:6], 2), (x, 3), (torch.stack([x[3], x[0]]), 0)):
            assert torch.equal(engine.runner.decode(batch)[pos], alone)
        assert set(seen) == {4}
    finally:
        engine.shutdown()


def test_decode_blocks_never_mix_latent_shapes(tiny_sd3_path):
    """Samples of different resolutions that finish together are decoded in blocks of their own shape (a block of
    mixed shapes cannot be stacked: it used to fail both requests), and each equals its solo run."""
    mixed = [r for pair in zip(requests(3, height=32), requests(3, height=48, prefix="t")) for r in pair]
    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, decode_batch_size=4)
    try:
        together = engine.generate(mixed)
        assert [o.stop_reason for o in together] == ["completed"] * 6
        for r, out in zip(mixed, together):
            (solo,) = engine.generate([r])
            assert tuple(out.diffusion_output.shape) == (3, r.sampling_params.height, 32)
            assert torch.equal(out.diffusion_output, solo.diffusion_output)
    finally:
        engine.shutdown()
