"""Video end to end: the CLI writes a video file (MP4, or animated WebP without an encoder) and a PNG strip; rewards
receive the whole video; the agent loop returns [B, T, 3, H, W] responses."""

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from omniroll.agent_loop import DataBatch, DiffusionAgentLoopWorker
from omniroll.cli import main
from omniroll.media import read_video, save_video, video_encoder
from omniroll.config import load_config
from omniroll.models.tiny import build_tiny
from omniroll.reward import RewardLoopWorker, RewardSample
from omniroll.reward.http import decode_safetensors_batch, encode_png_batch, encode_safetensors_batch
from omniroll.reward.scorers import jpeg_incompressibility, jpeg_size_kb
from omniroll.rollout import RolloutClient, create_replicas, kill_replicas


@pytest.fixture(scope="module")
def wan_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-cache")
    build_tiny("wan", str(root / "tiny-wan"), seed=0)  # where resolve_model("tiny-wan") looks
    return root


def test_generate_writes_videos_frame_strips_and_says_which_format(wan_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNIROLL_CACHE", str(wan_cache))
    out = tmp_path / "gen"
    rc = main(["generate", "--model", "tiny-wan", "--prompt", "a red cat", "--n", "2", "--steps", "2",
               "--height", "16", "--width", "32", "--frames", "5", "--fps", "8", "--max-sequence-length", "8",
               "--out", str(out), "--quiet"])
    assert rc == 0
    fmt = video_encoder()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
    assert json.loads(line)["video_format"] == fmt
    metrics = json.loads((out / "metrics.json").read_text())
    names = {Path(f).name for f in metrics["files"]}
    assert metrics["video_format"] == fmt and {f"prompt_000_s1.{fmt}", "prompt_000_s1_frames.png"} <= names
    assert read_video(out / f"prompt_000_s0.{fmt}").shape == (5, 3, 16, 32)  # MP4 (the video extra) or WebP
    with Image.open(out / "prompt_000_s0_frames.png") as strip:
        assert strip.size == (5 * 32, 16)
    with safe_open(str(out / "trajectories.safetensors"), "pt") as f:
        images = f.get_tensor("responses")
        assert images.shape == (2, 5, 3, 16, 32) and images.dtype == torch.uint8
        assert f.get_tensor("all_latents").shape == (2, 2, 16, 2, 2, 4)  # W + 1 = 2 latents of [C, t, h, w]
    with Image.open(out / "prompt_000_s0_frames.png") as strip:  # the strip is the video's frames, left to right
        frames = torch.from_numpy(np.array(strip.convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(frames, torch.cat(list(images[0]), dim=2))


def test_save_video_checks_its_input(tmp_path):
    with pytest.raises(ValueError, match=r"uint8 \[T, 3, H, W\]"):
        save_video(torch.zeros(5, 16, 16, 3, dtype=torch.uint8), tmp_path / "v", fps=8)
    path = save_video(torch.zeros(3, 3, 15, 17, dtype=torch.uint8), tmp_path / "odd", fps=8)
    assert path.suffix == "." + video_encoder() and path.exists()


def test_rewards_receive_the_video():
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, (4, 3, 16, 16), dtype=np.uint8)
    sample = RewardSample(sample_id="v", image=video, prompt="p")
    assert sample.is_video and sample.frames().shape == (4, 3, 16, 16)
    with pytest.raises(ValueError, match="video"):
        sample.hwc()
    assert jpeg_incompressibility([sample])[0] == pytest.approx(np.mean([jpeg_size_kb(f, 95) for f in video]))
    with pytest.raises(ValueError, match="encoding='safetensors'"):
        encode_png_batch([sample])
    images, prompts, _ = decode_safetensors_batch(encode_safetensors_batch([sample, sample]))
    assert images.shape == (2, 4, 3, 16, 16) and np.array_equal(images[1], video) and prompts == ["p", "p"]
    with pytest.raises(ValueError, match=r"\[T, 3, H, W\]"):
        RewardSample(sample_id="bad", image=video[:, :2], prompt="p")


def test_agent_loop_returns_video_responses(wan_cache, ray_cluster):
    path = str(wan_cache / "tiny-wan")
    replicas = create_replicas(1, path, {"max_batch_size": 4}, num_cpus=0)
    try:
        cfg = load_config({"engine": {"model": path, "max_batch_size": 4}, "prompt_length": 8, "seed": 1,
                           "pipeline": {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2,
                                        "guidance_scale": 3.0, "max_sequence_length": 8}})
        batch = DataBatch.from_dict(non_tensors={"uid": ["u0", "u0", "u1"], "raw_prompt": ["a cat", "a cat", "a dog"],
                                                 "data_source": ["t"] * 3}, meta_info={"global_steps": 1})
        scorer = RewardLoopWorker({"jpeg": {"fn": "jpeg_incompressibility"}})  # in-process reward worker
        worker = DiffusionAgentLoopWorker(cfg, RolloutClient(replicas), reward_loop_worker_handles=[scorer])
        out = asyncio.run(worker.generate_sequences(batch))
    finally:
        kill_replicas(replicas)
    b = out.batch
    assert b["responses"].shape == (3, 5, 3, 16, 16) and b["responses"].dtype == torch.uint8
    assert b["all_latents"].shape == (3, 2, 16, 2, 2, 2) and b["rollout_log_probs"].shape == (3, 1)
    expected = [np.mean([jpeg_size_kb(f, 95) for f in video.numpy()]) for video in b["responses"]]
    assert b["rm_scores"][:, 0].tolist() == pytest.approx(expected)  # the score of the whole video
    assert not torch.equal(b["responses"][0], b["responses"][1])
