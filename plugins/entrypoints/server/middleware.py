"""ASGI guard in front of every route: the Host header, the API key (all routes but probes), a cap on request
body size, a deadline for the body to arrive, and a bound on how deep a JSON body nests (parsers recurse per
level: a 10,000-deep body must cost a scan, not a parse that runs out of stack).

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect
notices pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Optional

from pagoda.plugins.entrypoints.server.errors import error_body
from pagoda.plugins.entrypoints.server.request_body import MAX_JSON_DEPTH, json_nesting_exceeds


# what probes and scrapers reach without the API key
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/load"})
# the operator routes, which need the admin API key when one is set (and then only it)
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def route_path(scope) -> str:
    """The path a request names under the app's root path (``--root-path``): ``/llm/health`` is ``/health`` when
    the root path is ``/llm``, as the router sees it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


class GuardMiddleware:
    def __init__(self, app: Any, api_key: Optional[str], max_request_bytes: int, body_timeout: float,
                 allowed_hosts: Optional[frozenset[str]] = None, admin_api_key: Optional[str] = None) -> None:
        self.app = app
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None
        self.allowed_hosts = allowed_hosts  # None: any Host header
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed_hosts is not None:
            host = _host_name(scope)
            if host not in self.allowed_hosts:
                # a page on another site resolving its name to this address (DNS rebinding) is refused here
                await send_error(send, 400, f"the Host header {host!r} is not a name this server answers to; "
                                             "add it to --allowed-hosts")
                return
        path = route_path(scope)
        if self.admin_api_key is not None and path in ADMIN_PATHS:
            if not self._authorized(scope, self.admin_api_key):
                await send_error(send, 401, "missing or wrong admin API key: this operator route needs the key of "
                                             "--admin-api-key as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
                return
        elif self.api_key is not None and path not in OPEN_PATHS and scope["method"] != "OPTIONS":
            if not self._authorized(scope, self.api_key):
                await send_error(send, 401, "missing or wrong API key; send it as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
                return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_request_bytes:
            await send_error(send, 413, self._too_large(declared))
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # read the body here, bounded, then replay it: an oversized chunked body never reaches the app
            chunks, size = [], 0
            deadline = asyncio.get_running_loop().time() + self.body_timeout
            while True:
                try:  # a client trickling its body, or sending less than its Content-Length, holds nothing for long
                    message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
                except asyncio.TimeoutError:
                    await send_error(send, 408, f"the request body did not arrive within {self.body_timeout:g} s "
                                                 "(--request-body-timeout); send the whole body at once",
                                      code="request_timeout", headers=[(b"connection", b"close")])
                    return
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_request_bytes:
                    await send_error(send, 413, self._too_large(size, at_least=True))
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            charset = _json_charset(scope)
            if charset not in (None, b"utf-8", b"utf8"):
                # JSON over HTTP is UTF-8 (RFC 8259); a body read as UTF-8 against its own declaration could mean
                # something other than its sender meant
                await send_error(send, 415, f"the request body declares charset={charset.decode('latin-1')[:40]}; "
                                             "this server reads JSON as UTF-8 only: send it as UTF-8 (charset=utf-8 "
                                             "or none)")
                return
            if _is_json(scope) and json_nesting_exceeds(body, MAX_JSON_DEPTH):
                await send_error(send, 400, "the request body nests JSON arrays and objects more than "
                                             f"{MAX_JSON_DEPTH} levels deep, which no request of this API needs; "
                                             "send a flatter body")
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _authorized(self, scope, key: bytes) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        token = header[7:].strip() if header[:7].lower() == b"bearer " else b""
        # constant time in the key's contents: no early exit on the first differing byte
        return hmac.compare_digest(token, key)

    def _too_large(self, size: int, at_least: bool = False) -> str:
        shown = f"more than {self.max_request_bytes}" if at_least else str(size)
        return (f"the request body is {shown} bytes, over the limit of {self.max_request_bytes} bytes "
                "(--max-request-bytes); send a smaller request")


def _host_name(scope) -> str:
    """The Host header without its port, lower-cased (``[::1]:8000`` -> ``::1``)."""
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1").strip().lower()
            if host.startswith("["):
                return host[1:host.find("]")] if "]" in host else host
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""


def _content_length(scope) -> Optional[int]:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _is_json(scope) -> bool:
    """The body is read as JSON: its content type says so, or it has none (as FastAPI reads it)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            return media_type == b"application/json" or (media_type.startswith(b"application/")
                                                          and media_type.endswith(b"+json"))
    return True


def _json_charset(scope) -> Optional[bytes]:
    """The charset a JSON body's Content-Type declares, lower-case (None: none declared, or not JSON)."""
    if not _is_json(scope):
        return None
    for name, value in scope["headers"]:
        if name == b"content-type":
            for param in value.split(b";")[1:]:
                key, _, given = param.partition(b"=")
                if key.strip().lower() == b"charset":
                    return given.strip().strip(b'"').lower()
    return None


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_error(send, status: int, message: str, code: Optional[str] = None,
                      headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
