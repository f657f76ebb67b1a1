"""benchmarks/gpu_train.py, the trainer's device check, on the CPU: `--smoke` runs the script end to end
on a tiny model (the LoRA and colocated modes and the rollout comparison; one table, one JSON line), and without a GPU
the script says so in one line and exits 0."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # the benchmark script in a subprocess
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_train.py")


def run(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_smoke_runs_every_mode_and_ends_with_one_json_line(tmp_path):
    p = run("--smoke", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["mode", "step", "img/s"]
    result = json.loads(lines[-1])
    assert result["benchmark"] == "gpu_train" and result["smoke"] and result["device"] == "cpu"
    steps = {r["mode"]: r for r in result["steps"]}
    assert set(steps) == {"lora", "colocated"}
    assert all(r["ratio_max_abs_dev"] == 0.0 and r["images_per_s"] > 0 and r["update_s"] > 0 for r in steps.values())
    assert steps["colocated"]["sleep_s"] > 0 and steps["colocated"]["wake_s"] > 0 and steps["lora"]["sleep_s"] is None
    assert steps["lora"]["peak_update_gb"] is None  # the CPU reports no device memory
    assert set(result["rollout_images_per_s"]) == {"diffusers", "omniroll_ode", "omniroll_sde"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    p = run(cwd=tmp_path)
    assert p.returncode == 0 and len(p.stdout.strip().splitlines()) == 1
    assert json.loads(p.stdout)["skipped"].startswith("no CUDA device here")
