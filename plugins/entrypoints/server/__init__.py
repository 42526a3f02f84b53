"""The OpenAI-compatible HTTP server: a FastAPI app whose routes come from ``pagoda_add_routes``.

``build_app`` wires an :class:`~pagoda.async_engine.AsyncLLMEngine` into an
app: every plugin's ``pagoda_add_routes(app, engine)`` adds its routes (the
built-in OpenAI routes arrive the same way), errors take OpenAI's shape, and a
guard checks the API key and the body size first. ``ServerThread`` runs the
app under uvicorn in a background thread (tests, embedding applications).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Optional

from fastapi import FastAPI

from pagoda.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server.errors import install_error_handlers
from pagoda.plugins.entrypoints.server.middleware import GuardMiddleware
from pagoda.version import __version__

DEFAULT_MAX_REQUEST_BYTES = 16 << 20


def build_app(engine: AsyncLLMEngine, api_key: Optional[str] = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, shutdown_timeout: float = 0.0) -> FastAPI:
    """The server app. The engine thread starts with the app and stops with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        # uvicorn has already waited (up to its graceful timeout) for open requests; fail what is left
        await engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="pagoda", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the pagoda inference engine")
    app.state.engine = engine
    install_error_handlers(app)
    engine.engine.pm.hook.pagoda_add_routes(app=app, engine=engine)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes)
    return app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; ``stop()`` shuts it down gracefully."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: Optional[int] = None,
                 graceful_timeout: float = 5.0) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                timeout_graceful_shutdown=graceful_timeout, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="pagoda-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
