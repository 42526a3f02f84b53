"""The server under bad input, overload and engine faults: a 4xx/5xx that names the problem, never a hang.

One real uvicorn server over the real default model with a small context
(64 tokens), two batch slots and a waiting queue of two, so every limit is
easy to reach. The last test kills the engine on purpose; keep it last.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app

MAX_MODEL_LEN = 64
MAX_REQUEST_BYTES = 1 << 20
BODY_TIMEOUT = 1.0
HEADER_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True,
               cpu_threads=1, max_model_len=MAX_MODEL_LEN, max_num_seqs=2, max_waiting_requests=2,
               kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def server(llm):
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), max_request_bytes=MAX_REQUEST_BYTES,
                                 strict_request_fields=True,
                                 body_timeout=BODY_TIMEOUT), header_timeout=HEADER_TIMEOUT).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def ok_completion(**extra):
    return {"prompt": "Hello", "max_tokens": 2, **extra}


def ok_chat(**extra):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}


C, CH = "/v1/completions", "/v1/chat/completions"
BAD_INPUT = [
    # (id, path, body, status, words the message must contain)
    ("invalid-json", C, b'{"prompt": "Hello",', 400, "not valid JSON"),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', 400, "JSON"),
    ("body-is-a-list", C, [1, 2], 400, "body"),
    ("missing-prompt", C, {"max_tokens": 2}, 400, "prompt: this field is required"),
    ("max-tokens-string", C, ok_completion(max_tokens="ten"), 400, "max_tokens"),
    ("temperature-string", C, ok_completion(temperature="hot"), 400, "temperature"),
    ("stream-string", C, ok_completion(stream="yes"), 400, "stream"),
    ("prompt-number", C, {"prompt": 5}, 400, "prompt"),
    ("messages-string", CH, {"messages": "Hi"}, 400, "messages"),
    ("max-tokens-negative", C, ok_completion(max_tokens=-1), 400, "max_tokens"),
    ("max-completion-tokens-negative", CH, ok_chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("prompt-logprobs-too-many", C, ok_completion(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("prompt-logprobs-streamed", C, ok_completion(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("chat-prompt-logprobs-streamed", CH, ok_chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("ignored-field-of-the-wrong-type", CH, ok_chat(store="yes"), 400, "store"),
    ("max-tokens-absurd", C, ok_completion(max_tokens=10 ** 12), 400, "max_tokens"),
    ("temperature-negative", C, ok_completion(temperature=-1), 400, "temperature"),
    ("temperature-absurd", C, ok_completion(temperature=1e9), 400, "temperature"),
    ("top-p-zero", C, ok_completion(top_p=0), 400, "top_p"),
    ("top-k-negative", C, ok_completion(top_k=-5), 400, "top_k"),
    ("penalty-out-of-range", C, ok_completion(presence_penalty=5), 400, "presence_penalty"),
    ("repetition-penalty-zero", C, ok_completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed-too-large", C, ok_completion(seed=2 ** 80), 400, "seed"),
    ("logprobs-too-many", C, ok_completion(logprobs=50), 400, "logprobs"),
    ("logit-bias-bad-key", C, ok_completion(logit_bias={"x": 1}), 400, "logit_bias"),
    ("logit-bias-absurd", C, ok_completion(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("logit-bias-outside-vocab", C, ok_completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("empty-stop-string", C, ok_completion(stop=[""]), 400, "stop"),
    ("stop-token-negative", C, ok_completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("min-tokens-over-max", C, ok_completion(min_tokens=5), 400, "min_tokens"),
    ("n-zero", C, ok_completion(n=0), 400, "n"),
    ("n-larger-than-allowed", C, ok_completion(n=17), 400, "n"),
    ("n-absurd", CH, ok_chat(n=10 ** 6), 400, "n"),
    ("prompt-over-max-model-len", C, ok_completion(prompt="word " * 200), 400, "maximum context length"),
    ("token-prompt-over-max-model-len", C, ok_completion(prompt=[42] * 100), 400, "maximum context length"),
    ("prompt-plus-max-tokens-over-max-model-len", C, ok_completion(max_tokens=MAX_MODEL_LEN), 400,
     "lower max_tokens"),
    ("chat-over-max-model-len", CH, ok_chat(messages=[{"role": "user", "content": "word " * 200}]), 400,
     "maximum context length"),
    ("empty-prompt", C, ok_completion(prompt=""), 400, "prompt"),
    ("empty-prompt-list", C, ok_completion(prompt=[]), 400, "prompt"),
    ("empty-token-list-in-batch", C, ok_completion(prompt=[[]]), 400, "prompt"),
    ("token-outside-vocab", C, ok_completion(prompt=[10 ** 9]), 400, "vocabulary"),
    ("token-negative", C, ok_completion(prompt=[-3]), 400, "prompt"),
    ("empty-messages", CH, ok_chat(messages=[]), 400, "messages"),
    ("unknown-role", CH, ok_chat(messages=[{"role": "robot", "content": "Hi"}]), 400, "role"),
    ("image-content-part", CH, ok_chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                               "image_url": {"url": "x"}}]}]),
     400, "content"),
    ("unknown-field", C, ok_completion(frobnicate=True), 400, "unrecognized request argument supplied: frobnicate"),
    ("unknown-chat-field", CH, ok_chat(functions=[]), 400, "unrecognized request argument supplied: functions"),
    ("top-logprobs-without-logprobs", CH, ok_chat(top_logprobs=2), 400, "logprobs"),
    ("stream-options-without-stream", C, ok_completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("suffix", C, ok_completion(suffix="end"), 400, "suffix"),
    ("best-of-not-n", C, ok_completion(best_of=3), 400, "best_of"),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [10 ** 9]}, 400, "vocabulary"),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt"),
    # one request must not be able to fail the engine step it is batched in
    ("top-k-beyond-64-bits", C, ok_completion(top_k=2 ** 63), 400, "top_k"),
    ("top-k-beyond-32-bits", CH, ok_chat(top_k=2 ** 31), 400, "top_k"),
    # JSON can carry unpaired UTF-16 surrogates, which no tokenizer encodes
    ("surrogate-in-prompt", C, b'{"prompt": "\\ud83d", "max_tokens": 2}', 400, "prompt: contains an unpaired UTF-16"),
    ("surrogate-in-stop", C, b'{"prompt": "Hi", "stop": "\\udc00"}', 400, "stop"),
    ("surrogate-in-chat-content", CH, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "content: contains an unpaired UTF-16"),
    ("surrogate-in-chat-part", CH, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     400, "unpaired UTF-16"),
    ("surrogate-in-tokenize-prompt", "/tokenize", b'{"prompt": "\\ud83d"}', 400, "prompt: contains an unpaired UTF-16"),
    # admission counts sequences: a request that could never fit the waiting queue is refused, not admitted alone
    ("more-sequences-than-the-queue", C, ok_completion(prompt=["a", "b"], n=2), 400, "4 sequences (prompts x n)"),
    # a prompt longer in characters than any max_model_len tokens can hold is refused before it is tokenized
    ("prompt-too-many-characters", C, ok_completion(prompt="x" * 900_000), 400, "characters"),
    ("chat-too-many-characters", CH, ok_chat(messages=[{"role": "user", "content": "x" * 900_000}]), 400,
     "characters"),
    ("tokenize-too-many-characters", "/tokenize", {"prompt": "x" * 900_000}, 400, "characters"),
]


@pytest.mark.parametrize("path,body,status,words", [case[1:] for case in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gets_a_4xx_that_names_the_problem(http, path, body, status, words):
    resp = post(http, path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_huge_body_gets_413_whether_its_length_is_declared_or_streamed(http):
    big = json.dumps({"prompt": "a" * (2 * MAX_REQUEST_BYTES)}).encode()
    resp = post(http, C, big)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]

    def chunked():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    resp = http.post(C, content=chunked(), headers={"content-type": "application/json"})
    assert resp.status_code == 413


def send_late(server, first: bytes, rest: bytes, timeout: float) -> tuple[bytes, float]:
    """On a new connection: ``first``, then ``rest`` one byte every 0.4 s (each in time, all of it not); what
    the server answers until it closes the connection, and the seconds from ``first`` sent to the close."""
    with socket.create_connection((server.host, server.port), timeout=timeout + 10) as sock:
        sock.sendall(first)
        started = time.monotonic()
        for byte in rest:
            time.sleep(0.4)
            sock.sendall(bytes([byte]))
        return read_until_closed(sock), time.monotonic() - started


def keep_alive_then(server, sent: bytes, timeout: float) -> tuple[bytes, float]:
    """On a new connection: a complete request, its answer, then ``sent``; as :func:`send_late`."""
    with socket.create_connection((server.host, server.port), timeout=timeout + 10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        sock.sendall(sent)
        return read_until_closed(sock), time.monotonic() - started


def read_until_closed(sock: socket.socket) -> bytes:
    response = b""
    while chunk := sock.recv(65536):
        response += chunk
    return response


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_is_closed(server, http):
    # two slow clients at once (each waits the timeout out): a body shorter than its Content-Length, and one
    # that trickles in a byte every 0.4 s
    body = json.dumps(ok_completion()).encode()
    head = (f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with ThreadPoolExecutor(2) as pool:
        late = [pool.submit(send_late, server, head + body[:5], rest, BODY_TIMEOUT) for rest in (b"", body[5:8])]
        for response, seconds in (f.result() for f in late):
            assert response.startswith(b"HTTP/1.1 408"), response
            assert b"--request-body-timeout" in response
            assert seconds < BODY_TIMEOUT + 5
    assert http.post(C, json=ok_completion()).status_code == 200


def test_a_connection_whose_headers_do_not_arrive_in_time_is_closed_with_408(server, http):
    # four slow clients at once (each waits the timeout out): nothing or half the headers, as a connection's
    # first request or after a complete one (the deadline holds for every request a connection carries)
    half = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"
    cases = [(sent, keep_alive) for sent in (b"", half) for keep_alive in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        late = [pool.submit(keep_alive_then, server, sent, HEADER_TIMEOUT) if keep_alive
                else pool.submit(send_late, server, sent, b"", HEADER_TIMEOUT) for sent, keep_alive in cases]
        for (sent, keep_alive), (response, seconds) in zip(cases, (f.result() for f in late)):
            if keep_alive and not sent:  # an idle keep-alive connection is closed without an answer
                assert response == b""
            else:
                assert response.startswith(b"HTTP/1.1 408"), (sent, keep_alive, response)
                error = json.loads(response.partition(b"\r\n\r\n")[2])["error"]
                assert "--request-header-timeout" in error["message"]
            assert HEADER_TIMEOUT - 0.2 < seconds < HEADER_TIMEOUT + 5, (sent, keep_alive, seconds)
    assert http.post(C, json=ok_completion()).status_code == 200


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(http):
    assert http.get("/v1/nothing").json()["error"]["message"]
    resp = http.get(C)
    assert resp.status_code == 405 and "error" in resp.json()


def test_the_server_keeps_serving_after_every_bad_request(http):
    for _, path, body, _, _ in BAD_INPUT:
        post(http, path, body)
    assert http.get("/health").status_code == 200
    resp = post(http, C, ok_completion(temperature=0))
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


# ---- property-based fuzzing of the OpenAPI request schemas ----------------------------------------

# output-length fields stay small so valid requests finish quickly
SMALL = {"max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4), "n": st.integers(1, 3),
         "min_tokens": st.integers(0, 2),
         "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=2)}
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3), max_leaves=6)


def from_schema(schema: dict, components: dict, valid: bool, name: str = "") -> st.SearchStrategy:
    """Values of an OpenAPI schema: within its bounds when ``valid``, anything of its shape otherwise."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, valid, name)
    if name in SMALL:
        return SMALL[name] if valid else st.one_of(SMALL[name], ANY_JSON)
    if name == "model":
        return st.none() if valid else st.text(max_size=8)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, components, valid, name) for s in schema[key]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, components, valid, k) for k, v in props.items() if k in required},
            optional={k: from_schema(v, components, valid, k) for k, v in props.items() if k not in required})
    if kind == "array":
        items = from_schema(schema.get("items", {}), components, valid, name)
        if valid:
            return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
        return st.lists(items, max_size=4)
    if kind == "integer":
        if not valid:
            return st.integers()
        lo = schema.get("minimum", -3)
        return st.integers(lo, schema.get("maximum", lo + 60000))
    if kind == "number":
        if not valid:
            return st.floats()
        lo, hi = schema.get("minimum", schema.get("exclusiveMinimum", -3.0)), schema.get("maximum", 3.0)
        return st.floats(lo, hi, exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0) if valid else 0, max_size=12)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def fuzz_bodies(app_schema: dict, model_name: str) -> st.SearchStrategy:
    """Valid bodies, valid bodies with one field broken or one unknown field, and arbitrary JSON."""
    components = app_schema["components"]["schemas"]
    ref = {"$ref": f"#/components/schemas/{model_name}"}
    valid = from_schema(ref, components, True)
    fields = list(components[model_name]["properties"])
    broken = st.tuples(valid, st.sampled_from(fields), from_schema(ref, components, False)).map(
        lambda t: {**t[0], t[1]: t[2].get(t[1], None)} if isinstance(t[2], dict) else t[0])
    unknown = st.tuples(valid, st.text(min_size=1, max_size=6), ANY_JSON).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, valid, broken, unknown, ANY_JSON)


def assert_no_server_error(http, path, body):
    # json.dumps writes NaN / Infinity for non-finite floats, which Python's JSON parser accepts: fuzz those too
    resp = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                     timeout=60)
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code == 200 and isinstance(body, dict) and body.get("stream") is True:
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text
        assert '"server_error"' not in resp.text, (body, resp.text)


@pytest.mark.slow
def test_fuzzed_completion_bodies_never_get_a_5xx(http):
    schema = http.get("/openapi.json").json()

    # without max_tokens a completion runs 16 tokens per prompt and choice: give the generated bodies a small
    # one unless they carry their own, so valid examples stay fast
    bodies = fuzz_bodies(schema, "CompletionRequest").map(
        lambda b: {"max_tokens": 2, **b} if isinstance(b, dict) else b)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies)
    def check(body):
        assert_no_server_error(http, C, body)

    check()
    assert http.get("/health").status_code == 200


@pytest.mark.slow
def test_fuzzed_chat_bodies_never_get_a_5xx(http):
    schema = http.get("/openapi.json").json()

    # chat's max_tokens defaults to "the rest of the context": give the generated bodies a small one unless
    # they carry their own, so valid examples stay fast
    bodies = fuzz_bodies(schema, "ChatCompletionRequest").map(
        lambda b: {"max_tokens": 3, **b} if isinstance(b, dict) and "max_completion_tokens" not in b else b)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies)
    def check(body):
        assert_no_server_error(http, CH, body)

    check()
    assert http.get("/health").status_code == 200


# ---- overload ------------------------------------------------------------------------------------


def test_past_the_waiting_queue_requests_get_503_with_retry_after_and_accepted_ones_complete(server, llm):
    async def one(client, i):
        body = {"prompt": f"Count to ten: {i}", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", C, json=body) as resp:
            text = (await resp.aread()).decode()
            return resp.status_code, resp.headers, text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    results = asyncio.run(main())
    refused = [(h, t) for status, h, t in results if status == 503]
    accepted = [t for status, _, t in results if status == 200]
    assert len(refused) + len(accepted) == 10
    assert refused and len(accepted) >= 2
    for headers, text in refused:
        assert int(headers["retry-after"]) >= 1
        error = json.loads(text)["error"]
        assert error["code"] == "overloaded" and "--max-waiting-requests" in error["message"]
    for text in accepted:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(e["choices"][0]["text"] for e in events)) > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


# ---- engine faults (keep last: the final test leaves the engine dead) ----------------------------


def fail_steps(monkeypatch, llm, when):
    executor = llm.engine.executor
    real = executor.execute
    calls = {"n": 0}

    def execute(sched):
        calls["n"] += 1
        if when(calls["n"]):
            raise RuntimeError("injected runner fault")
        return real(sched)

    monkeypatch.setattr(executor, "execute", execute)
    return calls


def test_an_engine_fault_fails_only_its_request_with_500_and_the_server_serves_on(server, http, llm, monkeypatch):
    # a fault that passes costs a retry within the step: the client never sees it
    calls = fail_steps(monkeypatch, llm, lambda n: n == 1)
    assert post(http, C, ok_completion(temperature=0)).status_code == 200
    assert calls["n"] >= 2
    monkeypatch.undo()

    # a fault that persists for a request fails it, with the cause
    fail_steps(monkeypatch, llm, lambda n: True)
    resp = post(http, C, ok_completion(temperature=0))
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert error["type"] == "server_error" and "injected runner fault" in error["message"]
    monkeypatch.undo()

    # a fault after the stream started ends it with an error event instead of hanging
    fail_steps(monkeypatch, llm, lambda n: n >= 3)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.APIError, match="injected runner fault"):
        for _ in client.completions.create(model=llm.engine.config.model.served_model_name, prompt="Hello",
                                           max_tokens=10, stream=True):
            pass
    monkeypatch.undo()
    assert http.get("/health").status_code == 200
    assert post(http, C, ok_completion()).status_code == 200
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_requests_that_fail_one_after_another_do_not_kill_an_engine_that_works(http, llm, monkeypatch):
    # the same bad input three times in a row: the engine checks itself and finds it can still run
    poisoned = {"prompt": "Hello poison", "max_tokens": 2}
    poison_ids = set(llm.engine.tokenizer.encode(poisoned["prompt"])) - set(llm.engine.tokenizer.encode("Hello"))
    executor = llm.engine.executor
    real = executor.execute

    def execute(sched):
        if any(poison_ids & set(r.prompt_token_ids) for r in sched.requests):
            raise RuntimeError("injected fault on one input")
        return real(sched)

    monkeypatch.setattr(executor, "execute", execute)
    statuses = [post(http, C, poisoned).status_code for _ in range(4)]
    assert statuses == [500] * 4
    assert http.get("/health").status_code == 200
    assert post(http, C, ok_completion()).status_code == 200
    monkeypatch.undo()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_an_engine_that_cannot_recover_reports_unhealthy_and_refuses_requests(http, llm, monkeypatch):
    fail_steps(monkeypatch, llm, lambda n: True)
    statuses = [post(http, C, ok_completion()).status_code for _ in range(4)]
    assert statuses == [500, 500, 500, 503]
    health = http.get("/health")
    assert health.status_code == 503 and "injected runner fault" in health.json()["error"]["message"]
