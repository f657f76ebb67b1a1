"""A small HTTP front end (FastAPI) for debugging and external callers; not on the training path.

`create_app(backend)` where backend is a `RolloutClient` (replicas) or an in-process `DiffusionEngine`.
POST /v1/generate {request_id?, prompt, negative_prompt?, seed, sampling_params?, return_trajectory?}
  -> {request_id, image_png_base64, log_probs, weight_version, seed, stop_reason[, trajectory]}
GET /health, GET /stats. JSON only (no pickle over the network); bad fields give 422/400 naming the field.
"""

from __future__ import annotations

import base64
import io
import uuid
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: Optional[str] = None
    prompt: str
    negative_prompt: Optional[str] = None
    seed: int = Field(ge=0, lt=2**63)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_trajectory: bool = False


def _png(pixels) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def create_app(backend: Any):
    from fastapi import FastAPI, HTTPException

    from omniroll.rollout.client import RequestError, RolloutClient, RolloutError, build_request

    app = FastAPI(title="omniroll rollout")

    async def generate(body: GenerateBody):
        rid = body.request_id or uuid.uuid4().hex
        if isinstance(backend, RolloutClient):
            return await backend.generate(rid, body.prompt, body.sampling_params, body.seed, body.negative_prompt)
        return await backend.generate_async(
            build_request(rid, body.prompt, body.sampling_params, body.seed, body.negative_prompt))

    @app.post("/v1/generate")
    async def generate_route(body: GenerateBody):
        try:
            out = await generate(body)
        except (RequestError, ValueError) as e:
            raise HTTPException(status_code=400, detail=str(e))
        except RolloutError as e:
            raise HTTPException(status_code=503, detail=str(e))
        ef = out.extra_fields
        resp = {"request_id": ef.get("request_id"), "stop_reason": out.stop_reason, "seed": ef.get("seed"),
                "weight_version": out.weight_version,
                "log_probs": out.log_probs.tolist() if out.log_probs is not None else None,
                "image_png_base64": _png(out.diffusion_output) if out.stop_reason == "completed" else None}
        if body.return_trajectory:
            resp["trajectory"] = {k: ef[k].tolist() for k in ("all_timesteps", "sigmas", "sigmas_next") if k in ef}
            resp["trajectory"]["sde_window"] = list(ef.get("sde_window", ()))
        return resp

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/stats")
    async def stats():
        return backend.stats()

    return app
