"""`HttpScorer`: score batches on a remote reward server over HTTP (JSON + base64 PNG, or safetensors). No pickle.

Wire format (one POST per batch of at most `batch_size` samples):

- `encoding="png"`: `Content-Type: application/json`, body
  `{"images": [base64 PNG, ...], "prompts": [...], "metadata": [{"sample_id", "data_source", "ground_truth",
  "extra_info"}, ...]}`.
- `encoding="safetensors"`: `Content-Type: application/octet-stream`, a safetensors file holding one uint8 tensor
  `images` of shape `[B, 3, H, W]` (video: `[B, T, 3, H, W]`; all samples of a batch must share a shape); its
  `__metadata__` holds `prompts` and `metadata` as JSON strings. Mixed shapes in one call are split into one request
  per shape. A video cannot go as `"png"` (one image per sample): that encoding refuses it with a clear error.

The server answers `{"scores": [...]}` with one entry per image (a number or a dict with `"score"`); a score must be
a finite number (`true` / `false`, strings, NaN are the scorer's errors, never 1.0 / 0.0: see `RewardManager`).
Servers can decode requests with `decode_png_batch` / `decode_safetensors_batch`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import weakref
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from PIL import Image

if TYPE_CHECKING:  # the optional `server` extra: imported when a request is made
    import httpx

RETRY_STATUSES = frozenset({408, 429})
ENCODINGS = ("png", "safetensors")
#: a PNG server's decode limits (`decode_png_batch`): pixels of one image (4096 x 4096, below PIL's decompression-bomb
#: threshold of ~89.5 M) and of one request's images together (32 x 1024 x 1024: ~100 MB of RGB). A PNG of a few kB can
#: declare 6000 x 6000 pixels; its size is read from its header and refused before anything is decoded.
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_REQUEST_PIXELS = 32 * 1024 * 1024


class RewardHTTPError(RuntimeError):
    """A reward server request failed for good; names the url, the last status (None: no response) and attempts."""

    def __init__(self, url: str, status: Optional[int], attempts: int, detail: str):
        self.url, self.status, self.attempts, self.detail = url, status, attempts, detail
        super().__init__(f"POST {url} failed after {attempts} attempt(s): status={status}: {detail}")


def _json_default(obj: Any):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _metadata(samples) -> list[dict]:
    return [
        {"sample_id": s.sample_id, "data_source": s.data_source, "ground_truth": s.ground_truth,
         "extra_info": s.extra_info}
        for s in samples
    ]


def _dumps(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj, default=_json_default)
    except (TypeError, ValueError) as e:
        raise ValueError(f"HttpScorer: {what} must be JSON serializable (ground_truth / extra_info): {e}") from e


def encode_png(image_chw: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0))).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_png_batch(samples) -> bytes:
    videos = [s.sample_id for s in samples if s.image.ndim == 4]
    if videos:
        raise ValueError(f"HttpScorer encoding='png' sends one PNG image per sample; samples {videos[:4]} are videos "
                         f"[T, 3, H, W]: use encoding='safetensors' (it sends [B, T, 3, H, W])")
    body = {"images": [encode_png(s.image) for s in samples], "prompts": [s.prompt for s in samples],
            "metadata": _metadata(samples)}
    return _dumps(body, "metadata").encode("utf-8")


def encode_safetensors_batch(samples) -> bytes:
    from safetensors.numpy import save

    shapes = {tuple(s.image.shape) for s in samples}
    if len(shapes) != 1:
        raise ValueError(f"HttpScorer encoding='safetensors' needs one image shape per batch, got {sorted(shapes)}")
    images = np.stack([s.image for s in samples]).astype(np.uint8, copy=False)
    meta = {"prompts": _dumps([s.prompt for s in samples], "prompts"),
            "metadata": _dumps(_metadata(samples), "metadata")}
    return save({"images": images}, metadata=meta)


def decode_png_batch(payload: dict, max_image_pixels: int = MAX_IMAGE_PIXELS,
                     max_request_pixels: int = MAX_REQUEST_PIXELS) -> tuple[list[np.ndarray], list[str], list[dict]]:
    """Server side: a JSON body of `encoding="png"` -> (CHW uint8 images, prompts, metadata). Every image's size is
    read from its header first: an image over `max_image_pixels`, or images over `max_request_pixels` together, are
    refused (ValueError naming them and the limit) before any pixel is decoded."""
    if not isinstance(payload, dict) or not isinstance(payload.get("images"), list):
        raise ValueError("body must be a JSON object with a list 'images'")
    opened, total = [], 0
    try:
        for i, b64 in enumerate(payload["images"]):
            try:
                im = Image.open(io.BytesIO(base64.b64decode(b64, validate=True)))  # reads the header only
            except Image.DecompressionBombError as e:  # PIL's own limit, far above ours: named the same way
                raise ValueError(f"images[{i}]: {e}; the limit is max_image_pixels={max_image_pixels}") from None
            opened.append(im)
            if im.format != "PNG":
                raise ValueError(f"images[{i}] must be a PNG, got {im.format}")
            w, h = im.size
            if w * h > max_image_pixels:
                raise ValueError(f"images[{i}] is {w}x{h} = {w * h} pixels, more than max_image_pixels="
                                 f"{max_image_pixels}")
            total += w * h
            if total > max_request_pixels:
                raise ValueError(f"images[0..{i}] have {total} pixels together, more than max_request_pixels="
                                 f"{max_request_pixels} (send fewer images per request)")
        images = [np.asarray(im.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1).copy() for im in opened]
    finally:
        for im in opened:
            im.close()
    prompts = payload.get("prompts", [""] * len(images))
    metadata = payload.get("metadata", [{} for _ in images])
    return images, list(prompts), list(metadata)


def decode_safetensors_batch(body: bytes) -> tuple[np.ndarray, list[str], list[dict]]:
    """Server side: a safetensors body -> (uint8 images `[B, 3, H, W]`, or videos `[B, T, 3, H, W]`, prompts,
    metadata). Never unpickles."""
    from safetensors.numpy import load

    if len(body) < 8:
        raise ValueError("safetensors body is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", body[:8])
    if n > len(body) - 8:
        raise ValueError(f"safetensors header length {n} exceeds the body ({len(body)} bytes)")
    header = json.loads(body[8:8 + n])
    meta = header.get("__metadata__") or {}
    tensors = load(body)
    if "images" not in tensors:
        raise ValueError(f"safetensors body must hold a tensor 'images', got {sorted(tensors)}")
    images = tensors["images"]
    if images.dtype != np.uint8 or images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError(f"'images' must be uint8 [B, 3, H, W] (video: [B, T, 3, H, W]), got {images.dtype} "
                         f"{tuple(images.shape)}")
    prompts = json.loads(meta.get("prompts", "[]"))
    metadata = json.loads(meta.get("metadata", "[]"))
    return images, prompts, metadata


class HttpScorer:
    """Batch scorer that POSTs to a reward server (see the module docstring for the wire format).

    `timeout_s` is a deadline for one whole attempt (connecting, sending and reading the complete response), so a
    server that drips its answer byte by byte is cut off at `timeout_s` like a silent one. `deadline_s` bounds a
    batch's attempts and backoff sleeps together: no attempt runs past it, and none starts when a backoff would end
    past it. Each batch is retried on timeouts, connection errors, 408, 429 and 5xx with exponential backoff
    (`min(max_backoff_s, backoff_s * 2**k)`, or the server's numeric `Retry-After` when smaller than `max_backoff_s`),
    for at most `max_retries` retries (`max_retries + 1` attempts). Other 4xx and malformed responses fail at once.
    A final failure raises `RewardHTTPError` (url, status, attempts). Batches of one call are sent concurrently.

    Defaults: a reward model scores a batch in seconds, so an attempt gets 30 s, a batch at most 60 s (two attempts
    of a hanging server, three of one that fails fast); the reward manager does not retry an `http` function on top
    (its `max_retries` defaults to 0 for it), so a hanging server fails its rows after 60 s.

    Returns, per sample, `{"score": float, "attempts": n}` (the manager records `attempts` in `extra_info`).
    """

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 2, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, batch_size: int = 32, encoding: str = "png",
                 headers: Optional[dict] = None, deadline_s: float = 60.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpScorer.url must start with http:// or https://, got {url!r}")
        _check_range("timeout_s", timeout_s, 1e-3, 3600.0)
        _check_range("deadline_s", deadline_s, 1e-3, 86400.0)
        _check_range("max_retries", max_retries, 0, 100, integer=True)
        _check_range("backoff_s", backoff_s, 0.0, 600.0)
        _check_range("max_backoff_s", max_backoff_s, 0.0, 3600.0)
        _check_range("batch_size", batch_size, 1, 65536, integer=True)
        if encoding not in ENCODINGS:
            raise ValueError(f"HttpScorer.encoding must be one of {ENCODINGS}, got {encoding!r}")
        try:
            import httpx  # noqa: F401
        except ImportError as e:
            raise ImportError("HttpScorer needs httpx: pip install 'omniroll[server]'") from e
        self.url, self.timeout_s, self.max_retries = url, float(timeout_s), int(max_retries)
        self.deadline_s = float(deadline_s)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.batch_size, self.encoding, self.headers = int(batch_size), encoding, dict(headers or {})
        self.requests_sent = 0  # HTTP attempts, all calls together
        self._clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = (
            weakref.WeakKeyDictionary()
        )

    def __repr__(self):
        return f"HttpScorer(url={self.url!r}, encoding={self.encoding!r}, batch_size={self.batch_size})"

    def _client(self) -> "httpx.AsyncClient":
        import httpx  # optional dependency (the `server` extra): imported only when a request is made

        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers)
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def __call__(self, samples) -> list[dict]:
        samples = list(samples)
        groups: dict[tuple, list[int]] = {(): list(range(len(samples)))}
        if self.encoding == "safetensors":  # one tensor per request: split mixed resolutions by shape
            groups = {}
            for i, s in enumerate(samples):
                groups.setdefault(tuple(s.image.shape), []).append(i)
        chunks = [idx[j:j + self.batch_size] for idx in groups.values() for j in range(0, len(idx), self.batch_size)]
        parts = await asyncio.gather(*(self._score_batch([samples[i] for i in c]) for c in chunks))
        out: list = [None] * len(samples)
        for chunk, part in zip(chunks, parts):
            for i, row in zip(chunk, part):
                out[i] = row
        return out

    def _delay(self, retry_index: int, response: Optional["httpx.Response"]) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * (2 ** retry_index))
        if response is not None:
            try:
                ra = float(response.headers.get("retry-after", ""))
                if 0 <= ra <= self.max_backoff_s:
                    delay = ra
            except ValueError:
                pass
        return delay

    async def _score_batch(self, batch) -> list[dict]:
        if self.encoding == "png":
            body, ctype = encode_png_batch(batch), "application/json"
        else:
            body, ctype = encode_safetensors_batch(batch), "application/octet-stream"
        response, attempts = await self.post(body, ctype)
        return self._parse(response, len(batch), attempts)

    async def post(self, body: bytes, content_type: str, url: Optional[str] = None) -> tuple["httpx.Response", int]:
        """POST `body` to `url` (default: this scorer's) under the retry policy of the class doc: the first response
        under 400 and the attempts it took; `RewardHTTPError` (url, last status, attempts) when it fails for good.
        Other scorers that speak another API over HTTP (`omniroll.reward.openai_judge`) send through it."""
        import httpx

        url = url or self.url
        client = self._client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        attempts, status, detail = 0, None, ""
        for retry_index in range(self.max_retries + 1):
            attempts += 1
            self.requests_sent += 1
            response = None
            limit = min(self.timeout_s, max(deadline - loop.time(), 0.0))
            try:  # the attempt's deadline covers connect, send and every read, not one read
                response = await asyncio.wait_for(
                    client.post(url, content=body, headers={"content-type": content_type}), limit)
            except (httpx.TimeoutException, asyncio.TimeoutError) as e:
                shown = self.timeout_s if limit == self.timeout_s else f"{limit:.3g}"  # cut short by deadline_s
                status, detail = None, f"timeout after {shown}s ({type(e).__name__})"
            except httpx.TransportError as e:
                status, detail = None, f"connection error ({type(e).__name__}: {e})"
            else:
                status = response.status_code
                if status < 400:
                    return response, attempts
                detail = f"HTTP {status}: {response.text[:200]!r}"
                if not (status in RETRY_STATUSES or status >= 500):
                    raise RewardHTTPError(url, status, attempts, detail + " (not retried: client error)")
            if retry_index < self.max_retries:
                delay = self._delay(retry_index, response)
                if loop.time() + delay >= deadline:
                    raise RewardHTTPError(url, status, attempts,
                                          detail + f" (deadline_s={self.deadline_s:g} reached: no time for a retry)")
                await asyncio.sleep(delay)
        raise RewardHTTPError(url, status, attempts, detail + f" (max_retries={self.max_retries} exhausted)")

    def _parse(self, response: "httpx.Response", n: int, attempts: int) -> list[dict]:
        try:
            data = response.json()
        except ValueError as e:
            raise RewardHTTPError(self.url, response.status_code, attempts, f"response is not JSON: {e}") from e
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list):
            raise RewardHTTPError(self.url, response.status_code, attempts,
                                  "response must be a JSON object with a list 'scores'")
        if len(scores) != n:
            raise RewardHTTPError(self.url, response.status_code, attempts,
                                  f"response has {len(scores)} scores for a batch of {n}")
        out = []
        for s in scores:
            row = dict(s) if isinstance(s, dict) else {"score": s}
            row["attempts"] = attempts
            out.append(row)
        return out


def _check_range(name: str, value, lo, hi, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not (lo <= value <= hi):
        kind = "an int" if integer else "a number"
        raise ValueError(f"HttpScorer.{name} must be {kind} in [{lo}, {hi}], got {value!r}")
