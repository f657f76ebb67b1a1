"""The reward side of benchmarks/agent_loop_overhead.py: a local HTTP scorer whose only cost is waiting, and the cost
of building HttpScorer request bodies from real images."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import torch


# --------------------------------------------------------------------------------------------------- reward server
class RewardServer:
    """FastAPI + uvicorn on 127.0.0.1 in a daemon thread. POST /score: parse the body (HttpScorer's png JSON or
    safetensors encoding), `await asyncio.sleep(latency)`, answer one deterministic score per image. Counts requests."""

    def __init__(self, latency: float):
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        self.latency = latency
        self.reset()
        app = FastAPI()

        async def score(request):  # a plain Starlette route: the raw request, no FastAPI body validation
            raw = await request.body()
            if request.headers.get("content-type", "").startswith("application/octet-stream"):
                from omniroll.reward.http import decode_safetensors_batch

                images = list(decode_safetensors_batch(raw)[0])  # HttpScorer's safetensors encoding
                scores = [float(im[0, 0, 0]) / 255.0 for im in images]
            else:
                images = json.loads(raw)["images"]  # HttpScorer's png encoding
                scores = [(len(b64) % 1000) / 1000.0 for b64 in images]
            self.requests += 1
            self.batch_sizes.append(len(images))
            await asyncio.sleep(self.latency)
            return JSONResponse({"scores": scores})

        app.add_route("/score", score, methods=["POST"])

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/score"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start within 20 s")
            time.sleep(0.01)

    def reset(self) -> None:
        self.requests = 0
        self.batch_sizes: list[int] = []

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()


def encode_costs(images: torch.Tensor) -> dict:
    """ms per image to build HttpScorer request bodies from real outputs: png (the default) vs safetensors."""
    import numpy as np

    from omniroll.reward import RewardSample
    from omniroll.reward.http import encode_png_batch, encode_safetensors_batch

    samples = [RewardSample(f"s{i}", np.ascontiguousarray(im.numpy()), "a prompt") for i, im in enumerate(images)]
    out = {}
    for name, fn in (("png", encode_png_batch), ("safetensors", encode_safetensors_batch)):
        t0 = time.perf_counter()
        body = b"".join(fn(samples[i:i + 8]) for i in range(0, len(samples), 8))
        out[name] = {"ms_per_image": 1000 * (time.perf_counter() - t0) / len(samples),
                     "kb_per_image": len(body) / 1000 / len(samples)}
    return out
