"""omniroll's HTTP server (FastAPI): the OpenAI images API plus omniroll's own routes. Not on the training path.

`create_app(backend)` where backend is an in-process `DiffusionEngine` or a `RolloutClient` (replicas). Routes:

- `POST /v1/images/generations`: the OpenAI images API (see `omniroll.http.openai_images`).
- `POST /v1/generate` {request_id?, prompt, negative_prompt?, seed, sampling_params?, return_trajectory?}
  -> {request_id, image_png_base64, log_probs, weight_version, seed, stop_reason[, trajectory]}: one sample, JSON.
- `POST /v1/rollout` {prompts, n, seed, global_step?, negative_prompt?, sampling_params?} -> a trajectory file
  (`application/octet-stream`, the layout of `omniroll.trajectory_file`: what `omniroll generate` and `omniroll rollout`
  write; `omniroll.trajectory_file.read_trajectories(response.content)` reads it). Sample j of prompt i gets the seed
  `derive_seed(seed, global_step, batch_prompt_uid(i), j)`, as in `omniroll generate` / `rollout`. Served when
  `create_app` is given `trajectory_file` (the layout is the agent loop's batch, a layer above this one, so the
  composer passes it in: `omniroll.http.serve` passes `omniroll.trajectory_file.trajectory_file`).
- `GET /v1/models`, `GET /health` (200 when it can serve, 503 asleep or shut down), `GET /stats` (JSON),
  `GET /metrics` (Prometheus text).

Every route keeps the contract in `omniroll.http.contract` (body limit 413, JSON errors naming the request,
400 / 503 / 500, never echoing the input, a disconnected client's samples aborted). JSON and safetensors only (no
pickle over the network).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from omniroll.http.backend import HttpBackend
from omniroll.http.contract import (
    DEFAULT_MAX_BODY_BYTES,
    ApiError,
    classify,
    install_contract,
    logger,
    request_id_of,
    run_until_disconnect,
)
from omniroll.http.metrics import ServerMetrics


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: Optional[str] = Field(None, min_length=1, max_length=128)
    prompt: str
    negative_prompt: Optional[str] = None
    seed: int = Field(ge=0, lt=2**63)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_trajectory: bool = False


class RolloutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(min_length=1)
    n: int = Field(1, ge=1)
    seed: int = Field(0, ge=0, lt=2**63)
    global_step: int = Field(0, ge=0)
    negative_prompt: Optional[str] = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)


class Server:
    """What the routes share: the backend, the metrics, the served model's name, and `run` (the contract)."""

    def __init__(self, backend: HttpBackend, model_name: str, max_n: int):
        self.backend, self.model_name, self.max_n = backend, model_name, max_n
        self.metrics = ServerMetrics()
        self.created = int(time.time())

    async def run(self, request, route: str, requests: list, texts: list) -> list:
        """Generate `requests` (GenerationRequests) for one HTTP request, under the contract: capacity, abort on
        disconnect or on the first failure, metrics, and every error classified (its message scrubbed of `texts`)."""
        state = self.backend.state()
        if state != "ok":
            raise ApiError(503, f"the engine is {state}; retry later", retry_after=5)
        self.metrics.samples_started(len(requests))
        try:
            with self.backend.reserve(len(requests)):
                outs = await run_until_disconnect(request, [self.backend.generate(r) for r in requests])
        except Exception as e:
            err = classify(e, texts)
            if err.status == 500:
                logger.error("request %s failed with a bug", request_id_of(request), exc_info=e)
            if err is not e:
                raise err from None
            raise
        finally:
            self.metrics.samples_finished(len(requests))
        for out in outs:
            self.metrics.sample_done(out.stop_reason)
        return outs


def create_app(backend: Any, model_name: str = "omniroll", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_pending: int = 1024, max_n: int = 64, request_timeout_s: float = 600.0,
               trajectory_file: Optional[Callable[[list, list[str], int, dict], bytes]] = None):
    """The FastAPI app over an engine or a RolloutClient (or an `HttpBackend` built from one). `trajectory_file`
    (completed outputs, n per prompt in order, the prompts, n, the run record -> file bytes) enables `/v1/rollout`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    from omniroll.rollout.client import build_request
    from omniroll.http.openai_images import png_base64, register_images_api
    from omniroll.sampling import batch_prompt_uid, derive_seed

    # 1. The backend (an engine or a client behind admission limits) and the app; the OpenAI images API.
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    if not isinstance(backend, HttpBackend):
        backend = HttpBackend(backend, max_pending=max_pending, request_timeout_s=request_timeout_s)
    server = Server(backend, model_name, max_n)
    app = FastAPI(title="omniroll", version="0.1.0")
    app.state.server = server
    register_images_api(app, server)

    # 2. omniroll's own routes: one sample with its log-probs, and a whole rollout as a trajectory file.
    @app.post("/v1/generate")
    async def generate(body: GenerateBody, request: Request):
        rid = body.request_id or request_id_of(request)
        request.scope["state"]["request_id"] = rid
        texts = [body.prompt, body.negative_prompt]
        try:
            req = build_request(rid, body.prompt, body.sampling_params, body.seed, body.negative_prompt)
        except Exception as e:  # noqa: BLE001 - classified: 400 for a bad field
            raise classify(e, texts) from None
        out = (await server.run(request, "/v1/generate", [req], texts))[0]
        ef = out.extra_fields
        resp = {"request_id": rid, "stop_reason": out.stop_reason, "seed": ef.get("seed"),
                "weight_version": out.weight_version,
                "log_probs": out.log_probs.tolist() if out.log_probs is not None else None,
                "image_png_base64": (await asyncio.to_thread(png_base64, out.diffusion_output)
                                     if out.stop_reason == "completed" else None)}
        if body.return_trajectory:
            resp["trajectory"] = {k: ef[k].tolist() for k in ("all_timesteps", "sigmas", "sigmas_next") if k in ef}
            resp["trajectory"]["sde_window"] = list(ef.get("sde_window", ()))
            resp["trajectory"]["step_weight_versions"] = list(ef.get("step_weight_versions", ()))
        return resp

    async def rollout(body: RolloutBody, request: Request):
        rid = request_id_of(request)
        texts = list(body.prompts) + [body.negative_prompt]
        if len(body.prompts) * body.n > backend.max_pending:
            raise ApiError(400, f"len(prompts) * n must be <= {backend.max_pending} (the server's max_pending), "
                                f"got {len(body.prompts) * body.n}", param="n")
        try:
            reqs = [build_request(f"{rid}-p{i}-s{j}", p, body.sampling_params,
                                  derive_seed(body.seed, body.global_step, batch_prompt_uid(i), j),
                                  body.negative_prompt)
                    for i, p in enumerate(body.prompts) for j in range(body.n)]
        except Exception as e:  # noqa: BLE001
            raise classify(e, texts) from None
        outs = await server.run(request, "/v1/rollout", reqs, texts)
        run = {"command": "serve /v1/rollout", "model": server.model_name, "request_id": rid,
               "seed": body.seed, "global_step": body.global_step}
        data = await asyncio.to_thread(trajectory_file, outs, list(body.prompts), body.n, run)  # off the loop
        return Response(data, media_type="application/octet-stream")

    if trajectory_file is not None:
        app.post("/v1/rollout")(rollout)

    # 3. What a client or an operator asks about: models, health, stats, Prometheus metrics.
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "omniroll"}]}

    @app.get("/health")
    async def health():
        state = backend.state()
        return JSONResponse({"ok": state == "ok", "status": state}, status_code=200 if state == "ok" else 503)

    @app.get("/stats")
    async def stats():
        return backend.stats()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(backend.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # 4. The contract every route keeps (body limit, error shapes, request ids, metrics), installed last.
    install_contract(app, max_body_bytes, server.metrics)  # last: it labels metrics by the routes above
    return app
