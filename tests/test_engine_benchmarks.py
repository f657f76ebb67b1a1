"""The engine's speed scripts run end to end on the shipped shapes model, small: benchmarks/engine_vs_diffusers.py
(`--smoke`: 4 pictures, 1 and 2 threads, its row-thread engines checked bitwise against a 1-thread engine) and
benchmarks/engine_profile.py (4 pictures), each ending with its JSON line. Their numbers are not asserted (a speed is
measured by running them, never in a test)."""

import json

import pytest

from benchmark_script import benchmark_script


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.slow  # ~20 s: every contender at two thread counts
def test_engine_vs_diffusers_smoke(torch_threads, capsys):
    with benchmark_script("engine_vs_diffusers") as mod:
        assert mod.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "every sample bitwise the 1-thread engine's" in out
    record = last_json(out)
    assert record["pictures"] == 4
    for name in ("inv_sde_64_1t", "inv_sde_rows_128_2t", "plain_ode_rows_128_2t"):
        assert record[f"ratio_{name}"] > 0


def test_engine_profile_runs(torch_threads, capsys):
    with benchmark_script("engine_profile") as mod:
        assert mod.main(["--prompts", "4"]) == 0
    record = last_json(capsys.readouterr().out)
    assert record["steps"] > 0 and abs(sum(record["shares"].values()) - 1.0) < 0.05
    assert sorted(record["pieces"]) == ["VAE decode of 4", "prompt encoding", "transformer forwards"]
