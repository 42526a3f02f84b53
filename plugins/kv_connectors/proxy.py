"""``pagoda kv-proxy``: disaggregated prefill and decode behind one OpenAI endpoint.

Each completion or chat completion is first sent to a prefill instance (``pagoda serve --kv-connector ...
--kv-role prefill``) with ``max_tokens`` 1 and no streaming: it computes the prompt, saves its full blocks to
the store and answers once they are there. The request itself then goes, unchanged, to a decode instance
(``--kv-role decode``), which loads those blocks at admission instead of computing them and streams (or
returns) the answer through the proxy. Instances are taken in turn. A prefill instance that cannot be reached
costs the decode instance the prefill, not the request; one that refuses the request (a 4xx) answers for it.
"""

import argparse
import itertools
import json
import logging
from typing import Any

logger = logging.getLogger("pagoda")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "x-request-id")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "kv-proxy", help="one OpenAI endpoint in front of prefill and decode instances sharing a KV connector",
        description="Sends each request's prefill (max_tokens 1) to a prefill instance, then the request to a "
                    "decode instance that loads the prompt's KV blocks from the shared store "
                    "(docs/kv_connectors.md).")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of pagoda serve --kv-role prefill instances (http://host:port)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URLs of pagoda serve --kv-role decode instances")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an instance may take to answer a request (default 600)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, one choice, no streaming."""
    first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    first.update(max_tokens=1, stream=False, n=1)
    return first


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout: float) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefill_urls = [u.rstrip("/") for u in prefill_urls]
    decode_urls = [u.rstrip("/") for u in decode_urls]
    app = FastAPI(title="pagoda kv-proxy")
    client = httpx.AsyncClient(timeout=timeout)
    turns = itertools.count()

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                            status_code=status)

    async def generate(request: Request) -> Any:
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return error(400, f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        turn = next(turns)
        prefill_url, decode_url = prefill_urls[turn % len(prefill_urls)], decode_urls[turn % len(decode_urls)]
        try:
            first = await client.post(prefill_url + path, json=prefill_body(body), headers=headers)
            if 400 <= first.status_code < 500:  # the request itself is wrong: the decode instance would say so too
                return Response(first.content, first.status_code, media_type=first.headers.get("content-type"))
            if first.status_code != 200:
                logger.warning("kv-proxy: prefill instance %s answered %d; the decode instance computes the prompt",
                               prefill_url, first.status_code)
        except httpx.HTTPError as exc:
            logger.warning("kv-proxy: prefill instance %s failed (%s); the decode instance computes the prompt",
                           prefill_url, exc)
        try:
            answer = await client.send(client.build_request("POST", decode_url + path, json=body, headers=headers),
                                       stream=True)
        except httpx.HTTPError as exc:
            return error(502, f"the decode instance {decode_url} failed: {exc}")

        streaming = answer.headers.get("content-type", "").startswith("text/event-stream")

        async def chunks():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the decode instance died mid-answer: say so rather than stop silently
                logger.warning("kv-proxy: decode instance %s failed mid-stream (%s)", decode_url, exc)
                if streaming:
                    event = {"error": {"message": f"the decode instance {decode_url} failed mid-stream: {exc}; "
                                                  "the answer is incomplete, send the request again",
                                       "type": "server_error", "code": 502}}
                    yield f"\n\ndata: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await answer.aclose()

        return StreamingResponse(chunks(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type"))

    for path in GENERATION_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            answer = await client.get(decode_urls[0] + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return error(502, f"the decode instance {decode_urls[0]} failed: {exc}")
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Any:
        down = []
        for url in prefill_urls + decode_urls:
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        return JSONResponse({"down": down}, status_code=503 if down else 200)

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app
