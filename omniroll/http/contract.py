"""The HTTP contract every omniroll server keeps (the rollout server and `omniroll serve` share it).

- Every HTTP request has an id: the `X-Request-Id` header when given (printable, <= 128 characters), else a fresh
  `req-<hex>`; every response carries it back in `X-Request-Id`, and every error body names it.
- Request bodies are limited (`max_body_bytes`): a larger `Content-Length` is refused with 413 before a byte is read,
  and a chunked body is cut off with 413 as soon as it passes the limit.
- Errors are JSON, in the OpenAI error shape: `{"error": {"message", "type", "param", "code", "request_id"}}`.
  Status codes: 400 a bad request (a field named in `param` and the message), 404 an unknown model or route,
  413 a body over the limit, 503 the server cannot take it now (asleep, overloaded, shut down, every replica failed,
  timed out; with `Retry-After`), 500 only for bugs (the traceback goes to the server log, never to the client).
- An error body never echoes the input: validation errors name the field and the rule, never the value sent, and
  the request's own texts are cut out of any message (the engine's messages included).
- A client that disconnects has its requests aborted: `run_until_disconnect` runs the request's generations while
  watching the connection, and cancels them (which aborts them in the engine or on the replica) when it closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any, Awaitable, Iterable, Optional

logger = logging.getLogger("omniroll.server")

#: Default request-body limit: far above any sane prompt batch, far below what would hurt the server.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_MAX_MESSAGE_CHARS = 500
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
          499: "client_closed_request", 500: "internal_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error with its HTTP status, the field it is about (`param`), and what to tell the client."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


class ClientDisconnected(ApiError):
    def __init__(self):
        super().__init__(499, "client disconnected; its requests were aborted")


def new_request_id(header: Optional[str]) -> str:
    if header and _REQUEST_ID_RE.match(header):
        return header
    return f"req-{uuid.uuid4().hex[:16]}"


def scrub(message: str, texts: Iterable[Any] = ()) -> str:
    """`message` without the request's own texts (cut out, longest first), bounded in length, always encodable."""
    for t in sorted((t for t in texts if isinstance(t, str) and len(t) >= 3), key=len, reverse=True):
        message = message.replace(t, "<text>").replace(repr(t), "<text>")
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    return message.encode("utf-8", "replace").decode("utf-8")


def classify(error: BaseException, texts: Iterable[Any] = ()) -> ApiError:
    """The one place where an exception becomes a status code."""
    from pydantic import ValidationError

    from omniroll.engine.errors import EngineAsleepError, EngineOverloadedError, EngineShutdownError
    from omniroll.rollout.client import RolloutError

    if isinstance(error, ApiError):
        return error
    texts = list(texts)
    if isinstance(error, ValidationError):
        return validation_error(error)
    if isinstance(error, ValueError):  # validation (RequestError included): this request only, nothing ran
        return ApiError(400, scrub(str(error), texts), param=_field_in(str(error)))
    if isinstance(error, EngineAsleepError):
        return ApiError(503, scrub(str(error), texts), retry_after=5)
    if isinstance(error, EngineOverloadedError):
        return ApiError(503, scrub(str(error), texts), retry_after=1)
    if isinstance(error, (RolloutError, TimeoutError, asyncio.TimeoutError)):
        return ApiError(503, scrub(str(error) or "timed out", texts), retry_after=1)
    if isinstance(error, EngineShutdownError):
        return ApiError(503, scrub(str(error), texts))
    return ApiError(500, f"internal error ({type(error).__name__}): {scrub(str(error), texts)}; "
                         "this is a bug, the traceback is in the server log")


def validation_error(error, locate=None) -> ApiError:
    """A pydantic (or FastAPI request) validation error -> 400 naming the fields and rules, never the values."""
    from omniroll.errors import validation_messages

    errors = list(error.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, "the body is not valid JSON")
    locate = locate or _body_key
    lines = validation_messages(error, with_input=False, locate=locate, empty_loc="body")
    param = next((locate(tuple(e["loc"])) for e in errors if e.get("loc")), None)
    return ApiError(400, "; ".join(lines), param=param or None)


def _body_key(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p != "body")


def _field_in(message: str) -> Optional[str]:
    m = re.match(r"^(?:request '[^']*': )?(?:bad sampling_params: )?([a-z_][a-z0-9_.]*)[ :]", message)
    return m.group(1) if m else None


def error_body(err: ApiError, request_id: str) -> dict:
    return {"error": {"message": err.message, "type": _TYPES.get(err.status, "error"), "param": err.param,
                      "code": err.status, "request_id": request_id}}


def error_response(err: ApiError, request_id: str):
    from fastapi.responses import JSONResponse

    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    return JSONResponse(error_body(err, request_id), status_code=err.status, headers=headers)


def request_id_of(request) -> str:
    return request.scope.get("state", {}).get("request_id") or "unknown"


def install_contract(app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics=None) -> None:
    """Add the body limit, the request ids and the JSON error handlers to a FastAPI app; with `metrics` (a
    `ServerMetrics`), count every request by route and status, with its latency."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc, request_id_of(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        return error_response(validation_error(exc), request_id_of(request))

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        message = {404: "no such route", 405: "method not allowed", 413: _too_large(max_body_bytes)}.get(
            exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, message), request_id_of(request))

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):  # routes classify what they expect; what reaches here is a bug
        rid = request_id_of(request)
        logger.error("request %s failed with a bug", rid, exc_info=exc)
        return error_response(ApiError(500, f"internal error ({type(exc).__name__}); this is a bug, the traceback "
                                            "is in the server log"), rid)

    routes = {getattr(r, "path", None) for r in app.routes}
    app.add_middleware(_ContractMiddleware, max_body_bytes=max_body_bytes, metrics=metrics, routes=routes)


def _too_large(limit: int) -> str:
    return f"request body is larger than the server's limit of {limit} bytes (max_body_bytes)"


class _ContractMiddleware:
    """Pure ASGI (it must not buffer the body or hide the disconnect): request id and body limit."""

    def __init__(self, app, max_body_bytes: int, metrics=None, routes=()):
        self.app, self.limit, self.metrics, self.routes = app, max_body_bytes, metrics, set(routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.metrics is None:
            return await self._serve(scope, receive, send, {})
        route = scope.get("path") if scope.get("path") in self.routes else "other"
        seen: dict = {"status": 500}
        t0 = time.perf_counter()
        self.metrics.request_started()
        try:
            await self._serve(scope, receive, send, seen)
        finally:
            self.metrics.request_finished(route, seen["status"], time.perf_counter() - t0)

    async def _serve(self, scope, receive, send, seen: dict):
        headers = dict(scope.get("headers") or ())
        rid = new_request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            err = ApiError(413, _too_large(self.limit)) if length.isdigit() else ApiError(400, "bad Content-Length")
            body = json.dumps(error_body(err, rid)).encode()
            await send_with_id({"type": "http.response.start", "status": err.status,
                                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                            (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    from starlette.exceptions import HTTPException

                    raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send_with_id)


async def _wait_for_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request, awaitables: list[Awaitable]) -> list:
    """Run `awaitables` concurrently and return their results in order. If the client disconnects first, or one of
    them fails, the others are cancelled (a cancelled generation is aborted in the engine / on its replica) and
    awaited, so nothing is left running for nobody; then ClientDisconnected or the first error is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    gathered = asyncio.gather(*tasks)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if gathered in done:
            return gathered.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not gathered.done():
            gathered.cancel()
        try:
            await gathered
        except BaseException:  # noqa: BLE001 - already reported above (or the client is gone)
            pass
