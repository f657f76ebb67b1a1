"""Run an ASGI app with uvicorn: a listening socket first (a bad address fails before anything loads), then the
server, in the foreground (`omniroll serve`) or in a daemon thread (`run_in_background`, for notebooks and tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator, Optional


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for sockets that say they are
    # TCP; without it Nagle holds a response's body behind its headers until the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on (none is refused while the server starts)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def uvicorn_server(app, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                         timeout_graceful_shutdown=5))


@contextlib.contextmanager
def run_in_background(app, host: str = "127.0.0.1", port: int = 0, sock: Optional[socket.socket] = None,
                      log_level: str = "warning") -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a daemon thread; yields its base URL; stops it on exit."""
    sock = sock or bind(host, port)
    server = uvicorn_server(app, log_level)
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
