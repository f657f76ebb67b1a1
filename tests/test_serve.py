"""`omniroll serve`: the OpenAI images API and the rollout endpoint on a live server on 127.0.0.1 (uvicorn in a
thread, the real engine on the tiny SD3), driven by the real `openai` client and by raw HTTP for the contract."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omniroll import GenerationRequest, SamplingParams
from omniroll.http.contract import ApiError, classify
from omniroll.http.runner import run_in_background
from omniroll.sampling import batch_prompt_uid
from omniroll.http.server import create_app
from omniroll.sampling import derive_seed
from omniroll.trajectory_file import read_trajectories, trajectory_file

EXTRA = {"num_inference_steps": 2, "max_sequence_length": 16, "guidance_scale": 1.0}
LIMIT = 64 * 1024
MARKER = "zebra-marker-7f3a"


@pytest.fixture(scope="module")
def live(tiny_sd3_path):
    from omniroll.engine.engine import DiffusionEngine

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    app = create_app(engine, model_name="tiny-test", max_body_bytes=LIMIT, max_pending=3, max_n=3,
                     trajectory_file=trajectory_file)
    with run_in_background(app) as url:
        yield url, engine
    engine.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _pixels(b64: str) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(base64.b64decode(b64))))).permute(2, 0, 1)


def test_openai_client_generates_the_engines_images(live):
    url, engine = live
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["tiny-test"]
    resp = client.images.generate(model="tiny-test", prompt="a red car", n=2, size="64x32",
                                  response_format="b64_json", extra_body={**EXTRA, "seed": 7, "noise_level": 0.5})
    assert len(resp.data) == 2 and [d.seed for d in resp.data] == [7, 8]
    sp = SamplingParams(height=32, width=64, noise_level=0.5, **EXTRA)
    direct = engine.generate([GenerationRequest(request_id=f"d{k}", prompt="a red car", seed=7 + k, sampling_params=sp)
                              for k in range(2)])
    for d, out in zip(resp.data, direct):
        assert torch.equal(_pixels(d.b64_json), out.diffusion_output)  # PNG is lossless: the engine's exact pixels
    assert resp.data[0].request_id.endswith("-0") and resp.data[0].revised_prompt is None


BAD = [  # (body fields, status, param)
    ({"size": "64x"}, 400, "size"),
    ({"size": "72x64"}, 400, "size"),
    ({"n": 4}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"response_format": "url"}, 400, "response_format"),
    ({"quality": "hd"}, 400, "quality"),
    ({"true_cfg_scale": 4.0}, 400, "true_cfg_scale"),  # SD3 has real CFG (guidance_scale): the model refuses it
    ({"num_frames": 5}, 400, "num_frames"),
    ({"bogus_field": 1}, 400, "bogus_field"),
    ({"noise_level": -1}, 400, "noise_level"),
    ({"sde_type": "xyz"}, 400, "sde_type"),
    ({"seed": -3}, 400, "seed"),
    ({"model": "other"}, 404, "model"),
]


@pytest.mark.parametrize("fields,status,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_request_names_field_and_never_echoes_input(live, fields, status, param):
    url, _ = live
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/images/generations", headers={"X-Request-Id": "bad-req-1"},
                      json={"prompt": f"a {MARKER} photo", "size": "64x64", **EXTRA, **fields})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["request_id"] == "bad-req-1" and r.headers["x-request-id"] == "bad-req-1"
    assert param in err["message"] and MARKER not in r.text and "xyz" not in r.text


def test_openai_client_raises_on_bad_request(live):
    url, _ = live
    with pytest.raises(openai.BadRequestError, match="size must be"):
        _client(url).images.generate(prompt="a cat", size="64x", extra_body=EXTRA)


def test_malformed_json_and_missing_prompt_are_400(live):
    url, _ = live
    with httpx.Client(base_url=url, timeout=30) as http:
        bad_json = http.post("/v1/images/generations", content=b'{"prompt": "' + MARKER.encode() + b'", ',
                             headers={"content-type": "application/json"})
        missing = http.post("/v1/images/generations", json={"size": "64x64"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.text and MARKER not in bad_json.text
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"


def test_body_limit_is_413_declared_or_chunked(live):
    url, _ = live
    big = json.dumps({"prompt": "x" * (LIMIT + 10)}).encode()

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    with httpx.Client(base_url=url, timeout=30) as http:
        declared = http.post("/v1/images/generations", content=big, headers={"content-type": "application/json"})
        chunked = http.post("/v1/generate", content=chunks(), headers={"content-type": "application/json",
                                                                        "X-Request-Id": "big-2"})
        assert http.get("/health").json() == {"ok": True, "status": "ok"}
    assert declared.status_code == 413 and "max_body_bytes" in declared.json()["error"]["message"]
    assert chunked.status_code == 413 and chunked.json()["error"]["request_id"] == "big-2"
    assert "xxxx" not in declared.text + chunked.text


def _engine_idle(engine) -> bool:
    st = engine.stats()
    return st["running"] == 0 and st["waiting"] == 0


def _wait(cond, what: str, deadline_s: float = 60.0):
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for: {what}"
        time.sleep(0.02)


def test_disconnect_aborts_its_samples_and_a_full_server_is_503(live):
    url, engine = live
    served = engine.stats()["served"]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a long one", "n": 3, "size": "64x64", "num_inference_steps": 1000,
                       "max_sequence_length": 16, "guidance_scale": 1.0}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        _wait(lambda: engine.stats()["running"] == 3, "the 3 samples to run")
        with httpx.Client(base_url=url, timeout=30) as http:
            full = http.post("/v1/images/generations", json={"prompt": "one more", "size": "64x64", **EXTRA})
        assert full.status_code == 503 and "overloaded" in full.json()["error"]["message"]
        assert full.headers["retry-after"] == "1" and full.json()["error"]["request_id"].startswith("req-")
    finally:
        sock.close()  # the client goes away mid-generation
    _wait(lambda: _engine_idle(engine), "the engine to drop the disconnected client's samples")
    assert engine.stats()["served"] == served  # aborted, not finished for nobody
    with httpx.Client(base_url=url, timeout=30) as http:
        _wait(lambda: 'code="499"' in http.get("/metrics").text, "the 499 to be counted")
        ok = http.post("/v1/images/generations", json={"prompt": "after", "size": "64x64", "n": 3, **EXTRA})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 3


def test_asleep_is_503_and_health_says_so(live):
    url, engine = live
    engine.sleep(1)
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", **EXTRA},
                          headers={"X-Request-Id": "sleepy-1"})
            health = http.get("/health")
    finally:
        engine.wake_up()
    assert r.status_code == 503 and r.json()["error"]["request_id"] == "sleepy-1" and "asleep" in r.text
    assert health.status_code == 503 and health.json()["status"] == "asleep"


def test_rollout_endpoint_returns_trajectories_as_safetensors(live):

    url, engine = live
    sp = {"height": 64, "width": 64, "num_inference_steps": 3, "max_sequence_length": 16, "guidance_scale": 4.5,
          "sde_window_size": 2}
    prompts = ["a red car", "a blue bird"]
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/rollout", json={"prompts": prompts, "n": 1, "seed": 5, "global_step": 2,
                                           "sampling_params": sp})
        bad = http.post("/v1/rollout", json={"prompts": prompts, "n": 2, "sampling_params": sp})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    traj = read_trajectories(r.content)  # the one trajectory layout (omniroll generate / rollout write the same)
    seeds = [derive_seed(5, 2, batch_prompt_uid(i), 0) for i in range(len(prompts))]
    assert list(traj.non_tensor_batch["seed"]) == seeds and list(traj.non_tensor_batch["raw_prompt"]) == prompts
    assert traj.batch["responses"].shape == (2, 3, 64, 64) and traj.batch["all_latents"].shape[:2] == (2, 3)
    direct = engine.generate([GenerationRequest(request_id=f"r{i}", prompt=p, seed=s, sampling_params=sp)
                              for i, (p, s) in enumerate(zip(prompts, seeds))])
    assert torch.equal(traj.batch["rollout_log_probs"], torch.stack([o.log_probs for o in direct]))
    assert torch.equal(traj.batch["responses"], torch.stack([o.diffusion_output for o in direct]))
    assert traj.meta_info["run"]["global_step"] == 2
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"  # 4 samples > max_pending 3


def test_metrics_are_prometheus_text(live):
    url, _ = live
    with httpx.Client(base_url=url, timeout=30) as http:
        http.post("/v1/images/generations", json={"prompt": "m", "size": "64x64", **EXTRA})
        text = http.get("/metrics").text
    values = dict(re.findall(r"^(\S+) (\S+)$", text, flags=re.M))
    assert float(values['omniroll_http_requests_total{route="/v1/images/generations",code="200"}']) >= 1
    assert float(values["omniroll_engine_steps_total"]) >= 2
    assert float(values["omniroll_engine_rows_total"]) >= float(values["omniroll_engine_steps_total"])
    assert values["omniroll_samples_in_flight"] == "0"
    assert float(values['omniroll_samples_total{stop_reason="completed"}']) >= 1
    route = 'route="/v1/images/generations"'
    count = values[f"omniroll_request_latency_seconds_count{{{route}}}"]
    assert values[f'omniroll_request_latency_seconds_bucket{{{route},le="+Inf"}}'] == count
    assert "# TYPE omniroll_request_latency_seconds histogram" in text


def test_status_codes_are_classified_in_one_place():
    from omniroll.engine.errors import EngineOverloadedError
    from omniroll.engine.lifecycle import EngineAsleepError
    from omniroll.rollout.client import RequestError, RolloutError

    secret = "my secret prompt"
    assert classify(RequestError("r", f"prompt {secret!r} is bad"), [secret]).status == 400
    assert secret not in classify(ValueError(f"prompt {secret!r} is too long"), [secret]).message
    assert classify(EngineAsleepError("asleep")).status == 503
    full = classify(EngineOverloadedError("the engine's queue is full"))
    assert full.status == 503 and full.retry_after == 1
    assert classify(RolloutError("every replica failed")).status == 503
    assert classify(TimeoutError()).status == 503
    bug = classify(RuntimeError(f"boom on {secret}"), [secret])
    assert bug.status == 500 and "bug" in bug.message and secret not in bug.message
    assert classify(ApiError(404, "x")).status == 404


@pytest.mark.slow  # slow: the server in a subprocess
def test_cli_serve_binds_127_0_0_1_and_serves(tiny_sd3_path, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    cli = "import sys; from omniroll.cli import main; sys.exit(main())"  # what the `omniroll` script runs
    proc = subprocess.Popen([sys.executable, "-c", cli, "serve", "--model", tiny_sd3_path, "--port", "0",
                             "--max-batch-size", "4"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"on (http://\S+) ", line)
            if m:
                url = m.group(1)
                break
        assert url and url.startswith("http://127.0.0.1:"), url
        resp = _client(url).images.generate(prompt="a cat", size="64x64", extra_body={**EXTRA, "seed": 1})
        assert _pixels(resp.data[0].b64_json).shape == (3, 64, 64)
    finally:
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=30)
    assert status == 130  # Ctrl-C: a graceful stop, then the CLI's exit status for SIGINT


@pytest.mark.parametrize("prompt", ["a \ud800 lone surrogate " + MARKER, MARKER * 600], ids=["surrogate", "too_long"])
def test_bad_prompt_is_400_naming_prompt(live, prompt):
    url, engine = live
    served = engine.stats()["served"]
    def post(path, body):  # json.dumps escapes a lone surrogate as \\ud800, as a JSON client would send it
        return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

    with httpx.Client(base_url=url, timeout=30) as http:
        r = post("/v1/images/generations", {"prompt": prompt, "size": "64x64", **EXTRA})
        g = post("/v1/generate", {"prompt": prompt, "seed": 1, "sampling_params": {**EXTRA, "height": 64, "width": 64}})
    for resp in (r, g):
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
        assert MARKER not in resp.text
    assert engine.stats()["served"] == served


def test_serve_config_serves_the_configs_replicas_on_ray(ray_cluster, tiny_sd3_path):
    """`omniroll serve --config`: the app over the config's replicas (a RolloutCluster, Ray already up here), each
    sample saying which replica and node made it; closing stops the replicas."""
    from omniroll.config import load_config
    from omniroll.http.serve import ServeConfig, build_app, close_backend

    cfg = load_config({"replicas": {"count": 2, "num_cpus": 0}, "engine": {"model": tiny_sd3_path,
                                                                           "max_batch_size": 4}})
    cluster, app = build_app(ServeConfig(model="unused", served_model_name="tiny"), cfg)
    try:
        assert len(cluster.replicas) == 2 and cluster.info.mode == "attached"
        sp = {"height": 64, "width": 64, "num_inference_steps": 2, "max_sequence_length": 16, "sde_window_size": 1}
        with run_in_background(app) as url, httpx.Client(base_url=url, timeout=120) as http:
            r = http.post("/v1/rollout", json={"prompts": ["a red car", "a blue bird"], "n": 2, "seed": 1,
                                               "sampling_params": sp})
        assert r.status_code == 200, r.text
        traj = read_trajectories(r.content)
        node = ray_cluster.get_runtime_context().get_node_id()
        assert list(traj.non_tensor_batch["replica_node_id"]) == [node] * 4
        assert set(traj.non_tensor_batch["replica_index"]) <= {0, 1}
    finally:
        close_backend(cluster)
    assert cluster.replicas == [] and ray_cluster.is_initialized()  # Ray was not this cluster's to stop
