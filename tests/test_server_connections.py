"""Connections no client can hold: a deadline for every request a connection carries (keep-alive ones too), and
at the connection limit the connections without a running request go first, so stalled clients cannot lock
out a normal one. Every answer uvicorn gives itself is in OpenAI's error shape.

One real uvicorn server over the real default model, with a long header deadline so that only the connection
limit can free the stalled connections while the normal client is served. A request without max_tokens gets the
server's default budget, not the rest of the context.
"""

from __future__ import annotations

import json
import resource
import socket
import time

import httpx
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app

LIMIT = 1024  # pagoda serve's default --limit-concurrency
NUM_STALLED = 1100
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
DEFAULT_MAX_TOKENS = 5  # what this server lets a request without max_tokens generate


@pytest.fixture(scope="module")
def server():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * NUM_STALLED + 512  # both ends of every connection live in this process
    if max(soft, hard) < needed and hard != resource.RLIM_INFINITY:
        pytest.skip(f"the open-file limit ({hard}) is below the {needed} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)) if hard != resource.RLIM_INFINITY
                                                else max(soft, 8192), hard))
    llm = LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), default_max_tokens=DEFAULT_MAX_TOKENS),
                       header_timeout=60.0, limit_concurrency=LIMIT).start()
    yield srv
    srv.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (or what arrived before the server closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def openai_error(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), response
    return json.loads(body)["error"]


def test_stalled_keep_alive_connections_past_the_limit_do_not_lock_out_a_normal_client(server):
    stalled = []
    try:
        for _ in range(NUM_STALLED):  # each: one complete request, then half of the next request line
            sock = socket.create_connection((server.host, server.port), timeout=30)
            sock.sendall(HEALTH)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /hea")
            stalled.append(sock)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            started = time.monotonic()
            models = client.get("/v1/models")
            elapsed = time.monotonic() - started
            assert models.status_code == 200 and elapsed < 1.0, (models.status_code, elapsed)
            done = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert done.status_code == 200, done.text
        # the oldest stalled connections made room, each told why in OpenAI's shape; the newest are still open
        first = until_closed(stalled[0])
        assert first.startswith(b"HTTP/1.1 503")
        assert "--limit-concurrency" in openai_error(first)["message"]
        stalled[-1].setblocking(False)
        with pytest.raises(BlockingIOError):
            stalled[-1].recv(1)  # nothing to read and not closed: it waits for its header deadline
    finally:
        for sock in stalled:
            sock.close()


def test_malformed_http_gets_a_400_in_the_openai_error_shape(server):
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n")
        response = until_closed(sock)
    assert response.startswith(b"HTTP/1.1 400")
    assert "not valid HTTP/1.1" in openai_error(response)["message"]


def test_a_request_without_max_tokens_gets_the_servers_default_budget(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"messages": [{"role": "user", "content": "Count to one hundred."}], "ignore_eos": True}
        answer = client.post("/v1/chat/completions", json=body).json()
        assert answer["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
        assert answer["choices"][0]["finish_reason"] == "length"
        # asked for more than the context holds: the error names the field the request used
        too_many = client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 10_000})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_completion_tokens"
        assert "lower max_completion_tokens" in too_many.json()["error"]["message"]
