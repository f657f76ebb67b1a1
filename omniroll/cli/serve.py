"""`omniroll serve`: the OpenAI images API (and omniroll's rollout and metrics routes) over HTTP, on one engine.

Binds 127.0.0.1 unless `--host` says otherwise; `--port 0` picks a free port. The URL is printed once the model is
loaded. Ctrl-C stops it (exit 130, as every command); SIGTERM too (uvicorn's graceful shutdown). Routes and the
HTTP contract: `omniroll.http.server`; defaults: `omniroll.http.serve.ServeConfig`.
"""

from __future__ import annotations

import os

HELP = "serve the OpenAI images API (plus /v1/rollout, /metrics) over HTTP on one engine"


def add_arguments(parser) -> None:
    # The defaults below marked SUPPRESS are ServeConfig's (an absent flag leaves its field alone), named in the help
    # so `omniroll --help` need not import the server.
    from argparse import SUPPRESS

    from omniroll.cli.common import rows_or_auto

    parser.add_argument("--model", default="tiny", help="'tiny' or a local diffusers SD3 checkpoint directory")
    parser.add_argument("--config", default=None,
                        help="serve this rollout config's replicas on Ray (engine, replicas.count / placement; "
                             "--model is then ignored) instead of one engine in this process (default: none)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (the default serves this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    parser.add_argument("--served-model-name", default=SUPPRESS,
                        help="the model id in /v1/models (default: the model's name)")
    parser.add_argument("--max-batch-size", type=rows_or_auto, default=SUPPRESS,
                        help="forward rows per step (default 16), or 'auto' (measured per shape)")
    parser.add_argument("--max-body-bytes", type=int, default=SUPPRESS,
                        help="larger request bodies get 413 (default 4 MiB)")
    parser.add_argument("--max-pending", type=int, default=SUPPRESS,
                        help="samples in flight over HTTP before requests get 503, overloaded (default 1024)")
    parser.add_argument("--max-n", type=int, default=SUPPRESS, help="images per request (default 64)")
    parser.add_argument("--request-timeout-s", type=float, default=SUPPRESS,
                        help="a request still running after this is aborted and answered 503 (default 600)")


def run(args) -> int:
    from omniroll.http.serve import ServeConfig, serve

    optional = {k: getattr(args, k) for k in ("served_model_name", "max_batch_size", "max_body_bytes", "max_pending",
                                              "max_n", "request_timeout_s") if hasattr(args, k)}
    cluster_config = None
    if args.config:
        from omniroll.cli.common import env_overrides
        from omniroll.config import load_config

        cluster_config = load_config(args.config, overrides=env_overrides())  # fails before Ray starts, naming the key
        optional.setdefault("served_model_name", os.path.basename(os.path.normpath(cluster_config.engine.model)))
    serve(ServeConfig(model=args.model, host=args.host, port=args.port, **optional), cluster_config)
    return 0
