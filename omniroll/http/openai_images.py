"""`POST /v1/images/generations`: the OpenAI images API, with omniroll's sampling fields as extra body fields.

OpenAI fields: `prompt` (required), `model` (optional; must be the served model's id), `n` (1..max_n), `size`
("WxH", or "auto" / absent for the model default), `response_format` ("b64_json", the default; "url" is refused:
omniroll stores no files), `user` (ignored). `quality`, `style`, `background`, `moderation`, `output_format`,
`output_compression`, `partial_images`, `stream` are accepted only at their defaults (absent, null, "auto", "png",
false) and refused otherwise, naming the field.

Extra body fields, as vLLM-Omni accepts them (top-level JSON fields; `extra_body={...}` in the openai client):
`negative_prompt`, `seed` (image k gets `seed + k`, so any image can be re-made alone with n=1; absent: a random
seed, returned), `num_inference_steps`, `guidance_scale`, `true_cfg_scale` (guidance-distilled models only; the
model refuses it otherwise), and every other `SamplingParams` field: `max_sequence_length`, `solver`, `noise_level`,
`sde_type`, `sde_window_size`, `sde_window_range`, `logprobs`, `latent_seed`, `noise_seeds`. Video fields
(`num_frames`, `fps`) and unknown fields are refused, naming the field.

Response: `{"created", "data": [{"b64_json", "revised_prompt": null, "seed", "request_id", "weight_version"}]}`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import secrets
import time
from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omniroll.engine.params import GenerationRequest, SamplingParams
from omniroll.http.contract import ApiError, classify, request_id_of, validation_error

#: SamplingParams fields a caller may set as extra body fields (size sets height and width; this route makes
#: still images as pixels: no frames, fps or output type).
SAMPLING_FIELDS = frozenset(SamplingParams.model_fields) - {"height", "width", "output_type", "num_frames", "fps"}
#: OpenAI fields with no meaning here, and the values that mean "the default" (accepted).
_DEFAULT_ONLY = {"quality": (None, "auto", "standard"), "style": (None,), "background": (None, "auto"),
                 "moderation": (None, "auto"), "output_format": (None, "png"), "output_compression": (None,),
                 "partial_images": (None, 0), "stream": (None, False)}
_SIZE_RE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


class ImagesBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str
    model: Optional[str] = None
    n: int = Field(1, ge=1)
    size: Optional[str] = None
    response_format: Optional[str] = None
    user: Optional[str] = None
    negative_prompt: Optional[str] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)


def parse_size(size: Optional[str], multiple: Optional[int]) -> dict:
    """"WxH" -> {"width": W, "height": H}; None / "auto" -> {} (the model's default)."""
    if size is None or size == "auto":
        return {}
    m = _SIZE_RE.match(size)
    if not m:
        raise ApiError(400, "size must be 'WIDTHxHEIGHT' in pixels (e.g. '256x256') or 'auto'", param="size")
    width, height = int(m.group(1)), int(m.group(2))
    if multiple and (width % multiple or height % multiple):
        raise ApiError(400, f"size: width and height must be multiples of {multiple} for this model, "
                            f"got {width}x{height}", param="size")
    return {"width": width, "height": height}


def build_requests(body: ImagesBody, rid: str, model_name: str, max_n: int,
                   multiple: Optional[int]) -> list[GenerationRequest]:
    """Validate every field (400 naming it) and return the n GenerationRequests; nothing runs before this."""
    if body.model is not None and body.model != model_name:
        raise ApiError(404, f"model: this server serves {model_name!r} only", param="model")
    if body.n > max_n:
        raise ApiError(400, f"n must be in [1, {max_n}], got {body.n}", param="n")
    if body.response_format not in (None, "b64_json"):
        raise ApiError(400, "response_format: only 'b64_json' is supported (omniroll stores no files)",
                       param="response_format")
    extra: dict[str, Any] = dict(body.model_extra or {})
    for name, allowed in _DEFAULT_ONLY.items():
        if extra.pop(name, None) not in allowed:
            raise ApiError(400, f"{name}: not supported by omniroll (only its default is accepted)", param=name)
    unknown = sorted(set(extra) - SAMPLING_FIELDS)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field (sampling fields: {', '.join(sorted(SAMPLING_FIELDS))})",
                       param=unknown[0])
    try:
        params = SamplingParams(**extra, **parse_size(body.size, multiple))
    except ValidationError as e:  # height and width came from `size`
        raise validation_error(e, locate=lambda loc: "size" if loc and loc[0] in ("height", "width")
                               else ".".join(map(str, loc))) from None
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    if seed + body.n > 2**63:
        raise ApiError(400, f"seed must be < 2**63 - n (image k uses seed + k), got {seed}", param="seed")
    try:
        return [GenerationRequest(request_id=f"{rid}-{k}", prompt=body.prompt, negative_prompt=body.negative_prompt,
                                  sampling_params=params, seed=seed + k) for k in range(body.n)]
    except Exception as e:  # noqa: BLE001 - e.g. the prompt's own validation: 400 naming the field
        raise classify(e, [body.prompt, body.negative_prompt]) from None


def png_base64(pixels) -> str:
    """uint8 pixels [3, H, W] -> a base64 PNG (the images API's `b64_json`, and `/v1/generate`'s image)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def register_images_api(app, server) -> None:
    @app.post("/v1/images/generations")
    async def images_generations(body: ImagesBody, request: Request):
        rid = request_id_of(request)
        requests = build_requests(body, rid, server.model_name, server.max_n, server.backend.spatial_multiple)
        outs = await server.run(request, "/v1/images/generations", requests,
                                [body.prompt, body.negative_prompt])
        images = await asyncio.to_thread(lambda: [png_base64(o.diffusion_output) for o in outs])  # off the loop
        return {"created": int(time.time()),
                "data": [{"b64_json": b64, "revised_prompt": None, "seed": r.seed, "request_id": r.request_id,
                          "weight_version": o.weight_version} for r, o, b64 in zip(requests, outs, images)]}
