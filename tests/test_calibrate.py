"""max_batch_size="auto": the engine measures its forward rows per batch key once, caches the choice on disk, and
the choice never changes a sample (batch-invariant mode)."""

import json

import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine import calibrate
from omniroll.engine.engine import DiffusionEngine


def requests(n, height=32):
    params = SamplingParams(height=height, width=32, num_inference_steps=3, max_sequence_length=16)
    return [GenerationRequest(request_id=f"c{i}", prompt=f"a cat {i}", seed=i, sampling_params=params)
            for i in range(n)]


def test_auto_rows_are_measured_once_cached_and_change_no_sample(tiny_sd3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIROLL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_memory", {})
    auto = DiffusionEngine.from_pretrained(tiny_sd3_path)
    fixed = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    try:
        outs = auto.generate(requests(6))
        rows = auto.scheduler.key_rows[requests(1)[0].sampling_params.batch_key()]
        assert rows in calibrate.CPU_CANDIDATES
        (key, ms_per_row), = auto.calibrator.measured.items()
        assert set(ms_per_row) == set(calibrate.CPU_CANDIDATES) and rows == min(ms_per_row, key=ms_per_row.get)
        assert json.loads((tmp_path / "calibration.json").read_text()) == {key: rows}
        assert auto.stats()["mean_rows_per_step"] <= rows
        for a, b in zip(outs, fixed.generate(requests(6))):
            assert torch.equal(a.diffusion_output, b.diffusion_output) and torch.equal(a.log_probs, b.log_probs)
    finally:
        auto.shutdown()
        fixed.shutdown()
    monkeypatch.setattr(calibrate, "_memory", {})  # a new process: the choice comes from disk, nothing is measured
    again = DiffusionEngine.from_pretrained(tiny_sd3_path)
    try:
        again.generate(requests(1))
        assert again.calibrator.measured == {}
        assert again.scheduler.key_rows == {requests(1)[0].sampling_params.batch_key(): rows}
    finally:
        again.shutdown()
