"""`omniroll serve`: one engine behind the HTTP server (uvicorn), bound to 127.0.0.1 unless told otherwise.

The composition of the layers below: the engine (`omniroll.engine`), the HTTP app (`omniroll.http.server`) and
the trajectory layout its `/v1/rollout` returns (`omniroll.trajectory_file`, the agent loop's batch on disk).

`serve(...)` runs until interrupted; `background_server(...)` runs the same server in a background thread and yields
its base URL (for notebooks, scripts and tests), shutting the server and the engine down on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

from omniroll.http.contract import DEFAULT_MAX_BODY_BYTES
from omniroll.http.runner import bind, run_in_background, uvicorn_server


@dataclass
class ServeConfig:
    model: str = "tiny"                   # "tiny" or a local diffusers checkpoint directory
    host: str = "127.0.0.1"
    port: int = 8000                      # 0: any free port
    served_model_name: Optional[str] = None  # the id in /v1/models and the `model` field; default: the path's name
    max_batch_size: int | str = 16       # or "auto" (see omniroll.engine.calibrate)
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


def build_app(config: ServeConfig, cluster_config=None):
    """What serves (loaded now, so a bad model path fails before the port opens) and the app over it: one engine in
    this process, or, with `cluster_config` (an OmniRollConfig / path), its replicas on Ray through a routing client
    (`omniroll.agent_loop.cluster.RolloutCluster`: Ray joined at RAY_ADDRESS or local, replicas placed as
    `replicas.placement` says). Returns (the engine or the cluster: `close_backend` stops it, the app)."""
    from omniroll.http.server import create_app
    from omniroll.trajectory_file import trajectory_file

    if cluster_config is not None:
        from omniroll.agent_loop.cluster import RolloutCluster
        from omniroll.rollout.client import RolloutClient

        backend = RolloutCluster(cluster_config, with_rewards=False, with_manager=False).start()
        cfg = backend.config
        serving = RolloutClient(backend.replicas, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries)
    else:
        from omniroll.engine.engine import DiffusionEngine
        from omniroll.models import resolve_model

        backend = serving = DiffusionEngine.from_pretrained(resolve_model(config.model),
                                                            max_batch_size=config.max_batch_size)
    app = create_app(serving, model_name=config.served_model_name, max_body_bytes=config.max_body_bytes,
                     max_pending=config.max_pending, max_n=config.max_n, request_timeout_s=config.request_timeout_s,
                     trajectory_file=trajectory_file)
    return backend, app


def close_backend(backend) -> None:
    """Stop what `build_app` started: the engine, or the cluster (replicas, then Ray if it started it)."""
    (backend.shutdown if hasattr(backend, "shutdown") else backend.close)()


def serve(config: ServeConfig, cluster_config=None) -> None:
    """Listen, load the model, print the URL, serve until Ctrl-C (KeyboardInterrupt, after uvicorn's graceful
    shutdown) or SIGTERM; the engine (or the cluster, see `build_app`) is shut down on the way out."""
    sock = bind(config.host, config.port)
    engine, app = build_app(config, cluster_config)
    host, port = sock.getsockname()[:2]
    print(f"omniroll serve: {config.served_model_name} on http://{host}:{port} "
          f"(POST /v1/images/generations, /v1/rollout, /v1/generate; GET /v1/models, /health, /metrics)",
          file=sys.stderr, flush=True)
    try:
        uvicorn_server(app, config.log_level).run(sockets=[sock])  # re-raises the Ctrl-C it handled gracefully
    finally:
        print("omniroll serve: stopped", file=sys.stderr, flush=True)
        close_backend(engine)
        sock.close()


@contextlib.contextmanager
def background_server(model: str = "tiny", port: int = 0, **kwargs) -> Iterator[str]:
    """Run `omniroll serve` in a background thread of this process; yields the base URL ("http://127.0.0.1:PORT").
    Keyword arguments are `ServeConfig` fields. The engine is shut down on exit."""
    config = ServeConfig(model=model, port=port, **kwargs)
    sock = bind(config.host, config.port)
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
