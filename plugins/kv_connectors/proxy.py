"""``pagoda kv-proxy``: disaggregated prefill and decode behind one OpenAI endpoint.

Each completion or chat completion is first sent to a prefill instance (``pagoda serve --kv-connector ...
--kv-role prefill``) with ``max_tokens`` 1 and no streaming: it computes the prompt, saves its full blocks to
the store and answers once they are there. The request itself then goes, unchanged, to a decode instance
(``--kv-role decode``), which loads those blocks at admission instead of computing them and streams (or
returns) the answer through the proxy. Instances are taken in turn. A prefill instance that cannot be reached
costs the decode instance the prefill, not the request; one that refuses the request (a 4xx) answers for it.
A streamed answer whose decode instance dies goes on on the next one, which gets the prompt's token ids and the
answer's tokens already sent (``Resumption``): the client sees one stream with one engine's tokens.
"""

import argparse
import contextlib
import itertools
import json
import logging
from typing import Any, AsyncIterator, Optional

from pagoda.kv.handoff import prefill_body

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


# --- a stream that outlives its decode instance -------------------------------------------------------------

# request fields whose meaning a continuation from token ids would lose: such a stream ends with an error event
# when its decode instance dies (structured outputs restart their grammar, tools and echo shape the whole answer)
NOT_RESUMABLE = ("tools", "response_format", "echo", "suffix", "logprobs", "top_logprobs", "best_of",
                 "prompt_logprobs", "continue_final_message")
# chat fields a /v1/completions continuation has no use for
CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
             "continue_final_message", "chat_template_kwargs", "documents", "reasoning_effort",
             "return_prompt_text", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
             "add_special_tokens", "chat_template")


def resumable(body: dict[str, Any]) -> bool:
    """Whether a streamed request can be continued on another decode instance from the tokens already sent."""
    return (bool(body.get("stream")) and body.get("n", 1) == 1
            and not any(body.get(k) not in (None, False) for k in NOT_RESUMABLE)
            and not any(k.startswith(("guided_", "structured_outputs")) for k in body))


class Resumption:
    """One streamed request's progress across decode instances: the prompt's and the answer's token ids (asked
    of the decode instance with ``return_token_ids``) and how to go on from them.

    The first instance's events go to the client as they are (less the token ids the client did not ask for);
    a continuation's events, answers of ``/v1/completions`` to the prompt's ids and the tokens already sent,
    are rewritten into the first stream's id, format (a chat delta for a chat request) and usage."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.path, self.body = path, body
        self.chat = path.endswith("/chat/completions")
        self.wants_ids = bool(body.get("return_token_ids"))
        self.prompt_ids: Optional[list[int]] = None
        self.sent_ids: list[int] = []  # the answer's token ids sent to the client
        self.head: dict[str, Any] = {}  # the first stream's id, created, model
        self.finished = False  # a finish_reason or [DONE] was sent: nothing to resume
        self.done = False  # [DONE] was sent
        self.segment = 0  # 0: the first decode instance; then each continuation
        self.reasoned = False  # a chat stream carried reasoning: a server-side parser's state would be lost
        self.sent_before = 0  # answer tokens sent before the current continuation

    def decode_body(self) -> dict[str, Any]:
        return {**self.body, "return_token_ids": True}

    def can_resume(self) -> bool:
        """False when the instance gave no prompt ids (not a pagoda server) or a chat stream carried reasoning."""
        return not self.finished and self.prompt_ids is not None and not self.reasoned

    def resume_body(self) -> dict[str, Any]:
        """The continuation: a completions request for the prompt's ids and those already sent, with the
        remaining token budget."""
        done = len(self.sent_ids)
        body = {k: v for k, v in self.body.items()
                if k not in CHAT_ONLY and k not in ("truncate_prompt_tokens", "truncation_side", "request_id")}
        body.update(prompt=list(self.prompt_ids) + self.sent_ids, stream=True, return_token_ids=True)
        limit = self.body.get("max_completion_tokens", self.body.get("max_tokens")) if self.chat \
            else self.body.get("max_tokens", 16)
        body["max_tokens"] = None if limit is None else max(0, limit - done)
        if body.get("min_tokens"):
            body["min_tokens"] = max(0, body["min_tokens"] - done)
        return body

    def rewrite(self, event: bytes) -> Optional[bytes]:
        """One SSE event as the client gets it (None: nothing to send), noting the ids it carries."""
        text = event.decode("utf-8", "replace").strip()
        if not text.startswith("data:"):
            return event + b"\n\n"
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            self.finished = self.done = True
            return b"data: [DONE]\n\n"
        try:
            chunk = json.loads(data)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict) or "error" in chunk:
            self.finished = True  # the instance itself answered with an error: that is the answer
            return event + b"\n\n"
        if self.segment == 0:
            self.head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
            ids = chunk.pop("prompt_token_ids", None)  # a chat stream's first chunk
            if ids is not None and self.prompt_ids is None:
                self.prompt_ids = list(ids)
                if self.wants_ids:
                    chunk["prompt_token_ids"] = ids
        usage = chunk.get("usage")
        if usage and self.segment > 0:  # the continuation counted the tokens sent before it as prompt
            usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.sent_before
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.sent_before
        choices = []
        for choice in chunk.get("choices") or []:
            ids = choice.pop("prompt_token_ids", None)
            if ids is not None and self.segment == 0 and self.prompt_ids is None:
                self.prompt_ids = list(ids)
                if self.wants_ids:
                    choice["prompt_token_ids"] = ids
            new = choice.pop("token_ids", None) or []
            self.sent_ids.extend(new)
            if self.wants_ids:
                choice["token_ids"] = new
            if (choice.get("delta") or {}).get("reasoning_content"):
                self.reasoned = True
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.segment > 0 and self.chat:  # a completions choice as a chat delta
                delta = {"content": choice.pop("text", "")}
                choice = {"index": choice.get("index", 0), "delta": delta, "logprobs": None,
                          "finish_reason": choice.get("finish_reason"),
                          **({"token_ids": new} if self.wants_ids else {})}
            choices.append(choice)
        if "choices" in chunk:
            chunk["choices"] = choices
        if self.segment > 0:
            chunk.update(self.head)
            if self.chat:
                chunk["object"] = "chat.completion.chunk"
                chunk.pop("system_fingerprint", None)
            if not choices and not usage:
                return None
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def next_segment(self) -> None:
        self.segment += 1
        self.sent_before = len(self.sent_ids)


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout: float) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefill_urls = [u.rstrip("/") for u in prefill_urls]
    decode_urls = [u.rstrip("/") for u in decode_urls]
    client = httpx.AsyncClient(timeout=timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagoda kv-proxy", lifespan=lifespan)
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
        if resumable(body):  # streamed: it goes on on another decode instance if this one dies
            state = Resumption(path, body)
            last_exc: Exception = RuntimeError("no decode instance")
            for attempt in range(len(decode_urls)):  # (one that cannot be reached: the next one)
                url = decode_urls[(turn + attempt) % len(decode_urls)]
                try:
                    answer = await client.send(client.build_request("POST", url + path, json=state.decode_body(),
                                                                    headers=headers), stream=True)
                except httpx.HTTPError as exc:
                    logger.warning("kv-proxy: decode instance %s failed (%s)", url, exc)
                    last_exc = exc
                    continue
                if answer.status_code != 200:
                    content = await answer.aread()
                    await answer.aclose()
                    return Response(content, answer.status_code, media_type=answer.headers.get("content-type"))
                return StreamingResponse(resumed(state, headers, turn + attempt, answer),
                                         media_type="text/event-stream")
            return error(502, f"no decode instance answered: {last_exc}")
        if not body.get("stream"):  # nothing reaches the client before the whole answer: a failure costs a retry
            failures = []
            for attempt in range(len(decode_urls)):
                url = decode_urls[(turn + attempt) % len(decode_urls)]
                try:
                    whole = await client.post(url + path, json=body, headers=headers)
                except httpx.HTTPError as exc:
                    logger.warning("kv-proxy: decode instance %s failed (%s); the next one answers", url, exc)
                    failures.append(f"{url}: {exc}")
                    continue
                return Response(whole.content, whole.status_code, media_type=whole.headers.get("content-type"))
            return error(502, "every decode instance failed: " + "; ".join(failures))
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
                    yield failed_event(decode_url, exc)
            finally:
                await answer.aclose()

        return StreamingResponse(chunks(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type"))

    def failed_event(url: str, exc: Exception) -> bytes:
        event = {"error": {"message": f"the decode instance {url} failed mid-stream: {exc}; the answer is "
                                      "incomplete, send the request again", "type": "server_error", "code": 502}}
        return f"\n\ndata: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()

    async def resumed(state: Resumption, headers: dict[str, str], turn: int, answer: Any) -> Any:
        """A streamed answer that goes on on the next decode instance when one dies: the continuation is asked
        for the prompt's token ids and those already sent, so the client gets the tokens one engine would give."""
        url = decode_urls[turn % len(decode_urls)]
        last_exc: Exception = RuntimeError("no decode instance")
        for attempt in range(len(decode_urls)):
            if attempt:
                url = decode_urls[(turn + attempt) % len(decode_urls)]
                if state.finished:  # the answer was whole: only its end was lost
                    if not state.done:
                        yield b"data: [DONE]\n\n"
                    return
                if not state.can_resume():
                    break
                state.next_segment()
                logger.warning("kv-proxy: the stream goes on on decode instance %s after %d tokens",
                               url, len(state.sent_ids))
                try:
                    answer = await client.send(client.build_request("POST", url + "/v1/completions",
                                                                    json=state.resume_body(), headers=headers),
                                               stream=True)
                except httpx.HTTPError as exc:
                    logger.warning("kv-proxy: decode instance %s failed (%s)", url, exc)
                    last_exc = exc
                    continue
                if answer.status_code != 200:  # the instance refused the continuation: its answer, as an event
                    content = await answer.aread()
                    await answer.aclose()
                    yield b"data: " + content + b"\n\ndata: [DONE]\n\n"
                    return
            pending = b""
            try:
                async for raw in answer.aiter_raw():
                    pending += raw.replace(b"\r\n", b"\n")
                    while b"\n\n" in pending:
                        event, pending = pending.split(b"\n\n", 1)
                        out = state.rewrite(event) if event.strip() else None
                        if out:
                            yield out
                out = state.rewrite(pending) if pending.strip() else None
                if out:
                    yield out
                return
            except httpx.HTTPError as exc:
                logger.warning("kv-proxy: decode instance %s failed mid-stream (%s)", url, exc)
                last_exc = exc
            finally:
                await answer.aclose()
        yield failed_event(url, last_exc)

    for path in GENERATION_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        """The first decode instance's list that answers (every instance serves the same model)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        failures = []
        for url in decode_urls:
            try:
                answer = await client.get(url + "/v1/models", headers=headers)
            except httpx.HTTPError as exc:
                failures.append(f"{url} ({exc})")
                continue
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        return error(502, f"no decode instance answered: {', '.join(failures)}")

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

    return app
