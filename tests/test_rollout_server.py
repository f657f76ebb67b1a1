"""HTTP front end over an in-process engine (httpx ASGI transport, no network)."""

import asyncio
import base64
import io

import httpx
import pytest
from PIL import Image

from omniroll.http.server import create_app

SP = {"height": 64, "width": 64, "num_inference_steps": 2, "max_sequence_length": 16, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def engine(tiny_sd3_path):
    from omniroll.engine.engine import DiffusionEngine

    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    yield eng
    eng.shutdown()


def test_generate_health_and_bad_fields(engine):
    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            ok = await c.post("/v1/generate", json={"prompt": "a red cat", "seed": 1, "sampling_params": SP,
                                                   "return_trajectory": True})
            bad = await c.post("/v1/generate", json={"prompt": "a", "seed": 1, "sampling_params": {**SP, "height": 8}})
            extra = await c.post("/v1/generate", json={"prompt": "a", "seed": 1, "bogus": 2})
            return ok, bad, extra, await c.get("/health"), await c.get("/stats")

    ok, bad, extra, health, stats = asyncio.run(go())
    assert ok.status_code == 200, ok.text
    body = ok.json()
    img = Image.open(io.BytesIO(base64.b64decode(body["image_png_base64"])))
    assert img.size == (64, 64) and len(body["log_probs"]) == 1 and body["trajectory"]["sde_window"] == [0, 1]
    assert body["trajectory"]["step_weight_versions"] == [0]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.height"
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "bogus"
    assert health.json() == {"ok": True, "status": "ok"} and stats.json()["served"] >= 1


def test_rollout_route_only_when_its_composer_passes_the_trajectory_layout(engine):
    """`create_app` alone knows nothing of the agent loop's layout: /v1/rollout is absent (404) unless given
    `trajectory_file` (as `omniroll serve` does), and then returns that file."""
    from omniroll.trajectory_file import read_trajectories, trajectory_file

    body = {"prompts": ["a red cat"], "n": 2, "seed": 3, "sampling_params": SP}

    async def go(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/rollout", json=body)

    assert asyncio.run(go(create_app(engine))).status_code == 404
    r = asyncio.run(go(create_app(engine, trajectory_file=trajectory_file)))
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert list(read_trajectories(r.content).non_tensor_batch["raw_prompt"]) == ["a red cat"] * 2
