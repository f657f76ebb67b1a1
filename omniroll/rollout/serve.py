"""`omniroll serve`: one engine behind the HTTP server (uvicorn), bound to 127.0.0.1 unless told otherwise.

`serve(...)` runs until interrupted; `background_server(...)` runs the same server in a background thread and yields
its base URL (for notebooks, scripts and tests), shutting the server and the engine down on exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

from omniroll.rollout.http_contract import DEFAULT_MAX_BODY_BYTES


@dataclass
class ServeConfig:
    model: str = "tiny"                   # "tiny" or a local diffusers checkpoint directory
    host: str = "127.0.0.1"
    port: int = 8000                      # 0: any free port
    served_model_name: Optional[str] = None  # the id in /v1/models and the `model` field; default: the path's name
    max_batch_size: int = 16
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_pending: int = 1024               # samples in flight over HTTP before 503 "overloaded"
    max_n: int = 64                       # images per request
    request_timeout_s: float = 600.0
    log_level: str = "warning"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.served_model_name is None:
            self.served_model_name = "tiny" if self.model == "tiny" else os.path.basename(
                os.path.normpath(self.model))


def build_app(config: ServeConfig):
    """The engine (loaded now, so a bad model path fails before the port opens) and the app over it."""
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.models import resolve_model
    from omniroll.rollout.server import create_app

    engine = DiffusionEngine.from_pretrained(resolve_model(config.model), max_batch_size=config.max_batch_size)
    app = create_app(engine, model_name=config.served_model_name, max_body_bytes=config.max_body_bytes,
                     max_pending=config.max_pending, max_n=config.max_n, request_timeout_s=config.request_timeout_s)
    return engine, app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on (none is refused while the server starts)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _uvicorn(app, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                         timeout_graceful_shutdown=5))


def serve(config: ServeConfig) -> None:
    """Listen, load the model, print the URL, serve until Ctrl-C (KeyboardInterrupt, after uvicorn's graceful
    shutdown) or SIGTERM; the engine is shut down on the way out."""
    sock = _bind(config.host, config.port)
    engine, app = build_app(config)
    host, port = sock.getsockname()[:2]
    print(f"omniroll serve: {config.served_model_name} on http://{host}:{port} "
          f"(POST /v1/images/generations, /v1/rollout, /v1/generate; GET /v1/models, /health, /metrics)",
          file=sys.stderr, flush=True)
    try:
        _uvicorn(app, config.log_level).run(sockets=[sock])  # re-raises the Ctrl-C it handled gracefully
    finally:
        print("omniroll serve: stopped", file=sys.stderr, flush=True)
        engine.shutdown()
        sock.close()


@contextlib.contextmanager
def background_server(model: str = "tiny", port: int = 0, **kwargs) -> Iterator[str]:
    """Run `omniroll serve` in a background thread of this process; yields the base URL ("http://127.0.0.1:PORT").
    Keyword arguments are `ServeConfig` fields. The engine is shut down on exit."""
    config = ServeConfig(model=model, port=port, **kwargs)
    sock = _bind(config.host, config.port)
    try:
        engine, app = build_app(config)
    except BaseException:
        sock.close()
        raise
    try:
        with run_in_background(app, sock=sock, log_level=config.log_level) as url:
            yield url
    finally:
        engine.shutdown()


@contextlib.contextmanager
def run_in_background(app, host: str = "127.0.0.1", port: int = 0, sock: Optional[socket.socket] = None,
                      log_level: str = "warning") -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a daemon thread; yields its base URL; stops it on exit."""
    sock = sock or _bind(host, port)
    server = _uvicorn(app, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="omniroll-serve", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        bound_host, bound_port = sock.getsockname()[:2]
        yield f"http://{bound_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
