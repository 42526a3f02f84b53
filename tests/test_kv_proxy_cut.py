"""`pagoda kv-proxy` when the decode instance dies mid-answer: the stream ends with a clear error event (the
client's openai library raises), not a silent truncation that looks like a finished answer."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pagoda.plugins.entrypoints.server import free_port
from plugins.kv_connectors.proxy import build_app


def start(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server


def test_a_decode_instance_dying_mid_stream_ends_the_stream_with_an_error_event():
    dying = FastAPI()  # a decode instance that streams one token, then its process goes away (connection cut)

    @dying.post("/v1/completions")
    async def completions():
        async def events():
            yield b'data: {"id":"c","object":"text_completion","created":0,"model":"m",' \
                  b'"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
            await asyncio.sleep(0.05)
            raise RuntimeError("decode instance killed")
        return StreamingResponse(events(), media_type="text/event-stream")

    up_port, proxy_port = free_port(), free_port()
    servers = [start(dying, up_port)]
    url = f"http://127.0.0.1:{up_port}"
    servers.append(start(build_app([url], [url], 30.0), proxy_port))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="x", max_retries=0)
        texts = []
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for chunk in client.completions.create(model="m", prompt="x", max_tokens=4, stream=True):
                texts.append(chunk.choices[0].text)
        assert texts == ["a"]
    finally:
        for server in servers:
            server.should_exit = True
