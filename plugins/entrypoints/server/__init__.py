"""The OpenAI-compatible HTTP server: a FastAPI app whose routes come from ``pagoda_add_routes``.

``build_app`` wires an :class:`~pagoda.engine.async_engine.AsyncLLMEngine` into an
app: every plugin's ``pagoda_add_routes(app, engine)`` adds its routes (the
built-in OpenAI routes arrive the same way), errors take OpenAI's shape, and a
guard checks the Host, the API key and the body first. ``make_uvicorn_server`` runs it under uvicorn
with a clean shutdown and a header deadline; ``ServerThread`` runs the
app under uvicorn in a background thread (tests, embedding applications).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from typing import Any, Optional

from fastapi import FastAPI

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server.errors import document_errors, install_error_handlers
from pagoda.plugins.entrypoints.server.middleware import GuardMiddleware
from pagoda.plugins.entrypoints.server.tools import ToolCallingOptions
from pagoda.version import __version__

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a request body to arrive in full
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a new connection's request line and headers to arrive
# after the drain at shutdown, how long uvicorn waits for the ended requests' connections to close
_CLOSE_SECONDS = 5.0


def build_app(engine: AsyncLLMEngine, api_key: Optional[str] = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, shutdown_timeout: float = 0.0,
              body_timeout: float = DEFAULT_BODY_TIMEOUT, allowed_hosts: Optional[frozenset[str]] = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None) -> FastAPI:
    """The server app. The engine thread starts with the app and stops with it. ``tool_call_parser`` names the
    ``pagoda_tool_parsers`` component that reads chat answers when ``tool_choice`` is ``auto``, which
    ``enable_auto_tool_choice`` allows (an unknown name is a ConfigError listing the parsers)."""
    tool_calling = ToolCallingOptions.resolve(engine.engine.pm, enable_auto_tool_choice, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        # uvicorn has already waited (up to its graceful timeout) for open requests; fail what is left
        await engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="pagoda", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the pagoda inference engine")
    app.state.engine = engine
    app.state.tool_calling = tool_calling  # read by the chat route
    install_error_handlers(app)
    document_errors(app)
    engine.engine.pm.hook.pagoda_add_routes(app=app, engine=engine)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes,
                       body_timeout=body_timeout, allowed_hosts=allowed_hosts)
    return app


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def default_allowed_hosts(host: str, api_key: Optional[str], allowed: Optional[str]) -> Optional[frozenset[str]]:
    """The Host names to answer: ``--allowed-hosts`` if given; on a loopback address without an API key only
    the loopback names (a web page cannot then reach the server through a name of its own); otherwise any."""
    if allowed:
        return frozenset(h.strip().lower() for h in allowed.split(",") if h.strip())
    if api_key is None and host in LOOPBACK_NAMES:
        return LOOPBACK_NAMES
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _header_deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection whose first request's headers have not arrived within
    ``seconds`` (a client trickling headers would otherwise hold its connection for ever); it answers 408."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_deadline = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request has begun on it
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                                     b"Connection: close\r\n\r\n")
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._header_deadline.cancel()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


def make_uvicorn_server(app: FastAPI, host: str, port: int, shutdown_timeout: float,
                        header_timeout: float = DEFAULT_HEADER_TIMEOUT, **options: Any):
    """uvicorn serving ``app``, with a shutdown that ends every open request cleanly.

    On SIGTERM (or ``should_exit``) the engine stops accepting, open requests get ``shutdown_timeout`` seconds
    to finish, and those still running are failed by the engine: a stream ends with an error event and
    ``[DONE]``, a plain request gets a 503. Only then does uvicorn close the connections, so none is cut
    mid-response. A shutdown that went this way exits with status 0, not by the signal. A connection whose
    headers take longer than ``header_timeout`` seconds is closed with a 408.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await app.state.engine.drain(shutdown_timeout)
            await super().shutdown(sockets)
            # uvicorn re-raises a caught SIGTERM after shutting down; a clean shutdown is a normal exit
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    # uvicorn's own wait for open connections comes after the drain: it only sees requests already ending
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=_CLOSE_SECONDS, lifespan="on",
                            http=_header_deadline_protocol(header_timeout), **options)
    return Server(config)


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; ``stop()`` shuts it down gracefully."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: Optional[int] = None,
                 graceful_timeout: float = 5.0, header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> None:
        self.host, self.port = host, port or free_port(host)
        self.server = make_uvicorn_server(app, self.host, self.port, graceful_timeout, header_timeout,
                                          log_level="warning")
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
