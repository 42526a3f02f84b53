"""An HTTP request forwarded from the ingress to one engine replica, and the replica's side of it."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pagoda.execution.routing import RoutingDecision, RoutingRequest

NO_PROMPT = RoutingRequest("", (), 0)


@dataclass
class ForwardedRequest:
    """What the ingress read of a client's request, and the prompt blocks it is routed by.

    ``target`` names the replica that must serve it (the ingress collecting every replica's
    metrics); ``decision`` and ``replica_names`` are filled in by the request router (in the
    ingress's process) when it chose a replica: the decision for the ingress to count, and the
    names of the replicas it chose among.
    """

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing: RoutingRequest = NO_PROMPT
    target: Optional[str] = None
    decision: Optional[RoutingDecision] = field(default=None, compare=False)
    replica_names: list[str] = field(default_factory=list, compare=False)


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica streams back: status line and headers."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def run_asgi(app: Any, request: ForwardedRequest, replica_name: str) -> AsyncIterator[Any]:
    """Run ``app`` (an ASGI application) on ``request``: yields a :class:`ResponseStart`, then body chunks.

    Closing the iterator early (the client went away) tells the app the client disconnected, so
    the request is aborted and its KV blocks freed as on a direct connection.
    """
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
             "query_string": request.query_string, "headers": request.headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + [(b"x-pagoda-replica", replica_name.encode())]
                yield ResponseStart(message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
