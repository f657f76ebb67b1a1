"""run_rollout (omniroll.run_rollout) end to end on the tiny SD3 (replicas, reward workers, manager) with files
written."""

import asyncio
import json
import os

from safetensors.torch import load_file

from omniroll.run_rollout import run_rollout
from omniroll.config import load_config


def test_run_rollout_writes_outputs(ray_cluster, tiny_sd3_path, tmp_path):
    cfg = load_config({
        "engine": {"model": tiny_sd3_path, "max_batch_size": 4},
        "replicas": {"count": 1, "num_cpus": 0},
        "pipeline": {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
                     "max_sequence_length": 16},
        "agent": {"num_workers": 1}, "prompt_length": 128, "seed": 1,
        "reward": {"num_workers": 1, "functions": {"jpeg": {"fn": "jpeg_compressibility"}}},
    })
    out = asyncio.run(run_rollout(cfg, ["a red cat", "a blue dog"], n=2, out_dir=str(tmp_path), progress=False))
    assert len(out) == 4 and out.batch["rm_scores"].shape == (4, 1)
    assert "negative_prompt_embeds" not in out.batch.keys()  # no CFG
    assert len(os.listdir(tmp_path / "images")) == 4
    lines = [json.loads(x) for x in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["ok"] * 4 and all(isinstance(x["score"], float) for x in lines)
    traj = load_file(str(tmp_path / "trajectories.safetensors"))
    assert traj["all_latents"].shape[:2] == (4, 2)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["metrics"]) == 4 and metrics["max_weight_version"] == 0
