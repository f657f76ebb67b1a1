"""`serving(app)`: an ASGI app served by a real uvicorn on 127.0.0.1 in a thread, for tests of HTTP clients (reward
servers, an OpenAI-compatible judge)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Callable, Iterator, Optional

import uvicorn


@contextlib.contextmanager
def serving(app, before_stop: Optional[Callable[[], None]] = None) -> Iterator[str]:
    """Serve `app` on a free port of 127.0.0.1 until the block ends; yields its base URL (`http://127.0.0.1:PORT`).
    `before_stop` runs first at the end (say, to release requests still hanging, so the server stops at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        if before_stop is not None:
            before_stop()
        srv.should_exit = True
        thread.join(timeout=5)
        sock.close()
