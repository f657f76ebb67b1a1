"""The command line, end to end on the tiny model."""

import json

import pytest
from safetensors import safe_open

from omniroll.cli import main


@pytest.fixture()
def tiny_cache(tiny_sd3_path, monkeypatch):
    # point the CLI's "tiny" at the session's tiny checkpoint (same builder, same seed)
    import os

    root = os.path.dirname(tiny_sd3_path)
    os.makedirs(root, exist_ok=True)
    link = os.path.join(root, "tiny-sd3")
    if not os.path.exists(link):
        os.symlink(tiny_sd3_path, link)
    monkeypatch.setenv("OMNIROLL_CACHE", root)


def test_generate_writes_grids_trajectories_metrics(tiny_cache, tmp_path):
    out = tmp_path / "gen"
    rc = main(["generate", "--model", "tiny", "--prompt", "a red car", "--prompt", "a dog", "--n", "2",
               "--steps", "4", "--height", "64", "--width", "64", "--max-sequence-length", "16",
               "--window-size", "2", "--window-range", "0", "3", "--out", str(out), "--quiet"])
    assert rc == 0
    assert (out / "prompt_000.png").exists() and (out / "prompt_001.png").exists()
    with safe_open(str(out / "trajectories.safetensors"), "pt") as f:
        assert f.get_tensor("images").shape == (4, 3, 64, 64)
        assert f.get_tensor("all_latents").shape[:2] == (4, 3)
        assert f.get_tensor("log_probs").shape == (4, 2)
        assert json.loads(f.metadata()["prompts"]) == ["a red car", "a dog"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_images"] == 4 and metrics["images_per_second"] > 0


def test_generate_bad_input_is_a_clear_error(tiny_cache, tmp_path, capsys):
    rc = main(["generate", "--model", "tiny", "--prompt", "x", "--steps", "0", "--out", str(tmp_path), "--quiet"])
    assert rc == 2 and "num_inference_steps" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "x", "--out", str(tmp_path), "--quiet"])
    assert rc == 2 and "model_index.json" in capsys.readouterr().err


def test_demo(tiny_cache, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    assert "omniroll demo" in printed and "trajectories.safetensors" in printed


def test_rollout_command(tiny_cache, tmp_path, ray_cluster):
    out = tmp_path / "roll"
    rc = main(["rollout", "--config", "examples/rollout.yaml", "--prompts", "examples/prompts.txt", "--n", "2",
               "--out", str(out), "--quiet", "--override", "replicas.count=1", "--override", "pipeline.height=64",
               "--override", "pipeline.width=64", "--override", "pipeline.num_inference_steps=4",
               "--override", "pipeline.max_sequence_length=16", "--override", "reward.num_workers=1",
               "--override", "algo.sde_window_range=[0,3]", "--override", "algo.sde_window_size=2"])
    assert rc == 0
    lines = (out / "rewards.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["status"] == "ok" for line in lines)
    assert (out / "metrics.json").exists()
