"""What one request can cost the server is bounded before any work is done for it, and the tokenizer thread is
shared fairly: a small request is answered while a maximal one is being tokenized.

One real uvicorn server over the real default model (a 512-token context, so one prompt may have 512 times
the longest token's characters), with --max-request-chars set so that a maximal request is 64 prompts near
that per-prompt limit. Every list field of the request bodies has a bound in the OpenAPI document, a body
nested too deep is refused before it is parsed, and unpaired UTF-16 surrogates are a 400 naming the field
wherever they are.
"""

from __future__ import annotations

import random
import string
import threading
import time

import httpx
import openai
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.request_body import (MAX_CHOICES, MAX_CONTENT_PARTS, MAX_ID_CHARS,
                                                            MAX_JSON_DEPTH, MAX_LOGIT_BIAS, MAX_MESSAGES,
                                                            MAX_METADATA_KEYS, MAX_NAME_CHARS, MAX_PROMPTS,
                                                            MAX_SHORT_LIST, MAX_STOP, MAX_STOP_CHARS,
                                                            MAX_STOP_TOKEN_IDS, MAX_TOKEN_IDS, MAX_TOOL_CALLS,
                                                            MAX_TOOLS)
from pagoda.plugins.entrypoints.server.serving import REQUEST_CHARS_FACTOR, ServingContext, longest_token_chars
from pagoda.plugins.entrypoints.server.tokenizer_turns import MAX_INLINE_CHARS, TokenizerTurns

MAX_MODEL_LEN = 512
C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
               kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def max_prompt_chars(llm):
    """The per-prompt limit: no token covers more characters than the longest one."""
    return MAX_MODEL_LEN * longest_token_chars(llm.engine.tokenizer)


@pytest.fixture(scope="module")
def max_request_chars(max_prompt_chars):
    """Room for 64 prompts each a little shorter than the per-prompt limit, not for 64 at the limit."""
    return MAX_PROMPTS * max_prompt_chars - 1000


@pytest.fixture(scope="module")
def server(llm, max_request_chars):
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), max_request_chars=max_request_chars)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def words(rng: random.Random, num_chars: int) -> str:
    """Text of random lower-case words: few repeat, so the tokenizer's cache of words does not help it."""
    return "".join(rng.choices(string.ascii_lowercase * 5 + " ", k=num_chars))


@pytest.fixture(scope="module")
def maximal_request(max_prompt_chars):
    """64 prompts, each 100 characters short of the per-prompt limit: within every bound, and refused only
    after all of it is tokenized (each prompt has more tokens than the context)."""
    rng = random.Random(0)
    return {"prompt": [words(rng, max_prompt_chars - 100) for _ in range(MAX_PROMPTS)], "max_tokens": 1}


@pytest.fixture(scope="module")
def maximal_request_seconds(http, maximal_request):
    """How long the maximal request takes alone: about its tokenizing."""
    start = time.monotonic()
    resp = http.post(C, json=maximal_request)
    seconds = time.monotonic() - start
    assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"], resp.text
    return seconds


# ---- fair tokenization --------------------------------------------------------------------------------


# a prompt of at most MAX_INLINE_CHARS is tokenized on the event loop; a longer one takes a turn on the thread
@pytest.mark.parametrize("small_prompt", ["Hello", "Hello " * 400], ids=["on-the-event-loop", "a-turn-on-the-thread"])
def test_a_small_request_is_answered_while_a_maximal_one_is_tokenized(http, client, maximal_request,
                                                                      maximal_request_seconds, small_prompt):
    finished: dict[str, float] = {}
    # the small request alone first: the client's first call (its lazy imports, a connection) is not counted
    # against the turns, and what the small request costs unhindered is known
    start = time.monotonic()
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=small_prompt, max_tokens=1)
    small_alone_seconds = time.monotonic() - start

    def send_maximal():
        resp = http.post(C, json=maximal_request)
        finished["maximal"] = time.monotonic()
        finished["status"] = resp.status_code

    maximal = threading.Thread(target=send_maximal)
    maximal.start()
    time.sleep(max(0.3, maximal_request_seconds / 4))  # well into its 64 prompts
    assert "maximal" not in finished, "the maximal request ended before the small one was sent; make it larger"
    start = time.monotonic()
    answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt=small_prompt, max_tokens=1)
    small_finished = time.monotonic()
    maximal.join()
    small_seconds = small_finished - start
    assert answer.usage.completion_tokens == 1
    assert finished["status"] == 400
    # without turns the small request would wait for the rest of the 64 prompts: three quarters of the time
    assert small_finished < finished["maximal"], (small_seconds, maximal_request_seconds)
    assert small_seconds < small_alone_seconds + maximal_request_seconds / 3, \
        (small_seconds, small_alone_seconds, maximal_request_seconds)


def test_prompts_within_the_inline_limit_are_tokenized_at_once_and_larger_ones_left_to_the_thread(llm):
    turns = TokenizerTurns(llm.engine.tokenizer)
    encode = lambda tok, text: tok.encode(text)  # noqa: E731
    short = ["The capital of France is", "Hello"]
    assert turns.run_now(encode, short, sum(map(len, short))) == [llm.engine.tokenizer.encode(t) for t in short]
    assert turns.run_now(encode, ["x" * (MAX_INLINE_CHARS + 1)], MAX_INLINE_CHARS + 1) is None


def test_a_request_over_the_request_character_limit_is_refused_before_it_is_tokenized(
        http, max_prompt_chars, max_request_chars, maximal_request_seconds):
    rng = random.Random(1)
    prompt = words(rng, max_prompt_chars)
    start = time.monotonic()
    resp = http.post(C, json={"prompt": [prompt] * MAX_PROMPTS, "max_tokens": 1})  # each prompt within its limit
    seconds = time.monotonic() - start
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt"
    assert f"{MAX_PROMPTS * max_prompt_chars} characters" in error["message"]
    assert f"the {max_request_chars} a request may have (--max-request-chars)" in error["message"]
    assert seconds < maximal_request_seconds / 3, (seconds, maximal_request_seconds)


def test_the_default_request_character_limit_is_four_prompts_at_the_per_prompt_limit(llm, max_prompt_chars):
    ctx = ServingContext.for_engine(AsyncLLMEngine(llm.engine))
    assert ctx.max_prompt_chars == max_prompt_chars
    assert ctx.max_request_chars == REQUEST_CHARS_FACTOR * max_prompt_chars == 4 * max_prompt_chars


def test_a_chat_too_long_for_the_context_is_refused_before_it_is_tokenized(http, max_prompt_chars):
    # each message alone fits; together, with the tools' JSON, they cannot
    half = "x" * (max_prompt_chars // 2)
    resp = http.post(CH, json={"messages": [{"role": "user", "content": half}, {"role": "user", "content": half}],
                               "tools": [{"type": "function", "function": {"name": "f", "description": "y" * 100}}],
                               "tool_choice": "none"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages" and "characters" in resp.json()["error"]["message"]


# ---- sizes of the request fields ----------------------------------------------------------------------


def chat(**extra):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}


def completion(**extra):
    return {"prompt": "Hi", "max_tokens": 1, **extra}


def responses(**extra):
    return {"input": "Hi", "max_output_tokens": 1, **extra}


def tool_call(i: int) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}"}}


OVER_A_BOUND = [
    # (id, path, body, the field the 400 names)
    ("prompts", C, completion(prompt=["a"] * (MAX_PROMPTS + 1)), "prompt"),
    ("prompt-token-ids", C, completion(prompt=[1] * (MAX_TOKEN_IDS + 1)), "prompt"),
    ("prompt-token-lists", C, completion(prompt=[[1]] * (MAX_PROMPTS + 1)), "prompt"),
    ("ids-of-one-token-prompt-of-a-batch", C, completion(prompt=[[1], [1] * (MAX_TOKEN_IDS + 1)]), "prompt"),
    ("detokenize-tokens", "/detokenize", {"tokens": [1] * (MAX_TOKEN_IDS + 1)}, "tokens"),
    ("stop-strings", C, completion(stop=["x"] * (MAX_STOP + 1)), "stop"),
    ("stop-string-characters", C, completion(stop="x" * (MAX_STOP_CHARS + 1)), "stop"),
    ("stop-token-ids", C, completion(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ("logit-bias", C, completion(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    ("messages", CH, chat(messages=[{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)), "messages"),
    ("content-parts", CH, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]
                                          * (MAX_CONTENT_PARTS + 1)}]), "messages.0.content"),
    ("tool-calls", CH, chat(messages=[{"role": "user", "content": "Hi"}, {
        "role": "assistant", "tool_calls": [tool_call(i) for i in range(MAX_TOOL_CALLS + 1)]}]),
     "messages.1.tool_calls"),
    ("tools", CH, chat(tools=[tool(i) for i in range(MAX_TOOLS + 1)]), "tools"),
    ("guided-choice", CH, chat(guided_choice=["a"] * (MAX_CHOICES + 1)), "guided_choice"),
    ("structured-outputs-choice", C, completion(structured_outputs={"choice": ["a"] * (MAX_CHOICES + 1)}),
     "structured_outputs.choice"),
    ("metadata-keys", CH, chat(metadata={f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}), "metadata"),
    ("modalities", CH, chat(modalities=["text"] * (MAX_SHORT_LIST + 1)), "modalities"),
    ("name", CH, chat(messages=[{"role": "user", "content": "Hi", "name": "n" * (MAX_NAME_CHARS + 1)}]),
     "messages.0.name"),
    ("user", C, completion(user="u" * (MAX_ID_CHARS + 1)), "user"),
    ("tool-call-id", CH, chat(messages=[{"role": "user", "content": "Hi"}, {
        "role": "tool", "content": "42", "tool_call_id": "c" * (MAX_ID_CHARS + 1)}]), "messages.1.tool_call_id"),
    ("tokenize-messages", "/tokenize", {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)},
     "messages"),
    ("responses-input-items", R, responses(input=[{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)), "input"),
    ("responses-content-parts", R, responses(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]), "input.0.content"),
    ("responses-include", R, responses(include=["message.output_text.logprobs"] * (MAX_SHORT_LIST + 1)),
     "include"),
    ("responses-tools", R, responses(tools=[{"type": "function", "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]), "tools"),
    ("responses-user", R, responses(user="u" * (MAX_ID_CHARS + 1)), "user"),
]


@pytest.mark.parametrize("path,body,param", [case[1:] for case in OVER_A_BOUND], ids=[c[0] for c in OVER_A_BOUND])
def test_a_field_over_its_bound_gets_a_400_naming_it(http, path, body, param):
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and "at most" in error["message"], error["message"]
    assert len(error["message"]) < 2000  # the message quotes the value, bounded


def test_a_list_of_many_bad_items_costs_one_error_not_one_per_item(http):
    body = {"prompt": [[-1] * MAX_TOKEN_IDS] * 20, "max_tokens": 1}  # 2.6 million bad ids, within every bound
    start = time.monotonic()
    resp = http.post(C, json=body)
    seconds = time.monotonic() - start
    assert resp.status_code == 400, resp.text[:500]
    assert resp.json()["error"]["param"] == "prompt"
    assert "more problems" not in resp.json()["error"]["message"]  # a handful of errors, not millions
    assert seconds < 10, seconds  # an error per item took about 8 microseconds each: some 20 s


REQUEST_MODELS = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "TokenizeRequest",
                  "DetokenizeRequest")


def test_the_openapi_document_bounds_every_list_of_every_request_body(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    unbounded, seen = [], set()

    def walk(node, where):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                name = ref.rsplit("/", 1)[1]
                if name not in seen:
                    seen.add(name)
                    walk(schemas[name], name)
                return
            if node.get("type") == "array" and "maxItems" not in node:
                unbounded.append(where)
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    for model in REQUEST_MODELS:
        seen.add(model)
        walk(schemas[model], model)
    assert not unbounded, unbounded
    message = schemas["ChatMessage"]["properties"]
    assert message["name"]["anyOf"][0]["maxLength"] == MAX_NAME_CHARS
    assert message["tool_call_id"]["anyOf"][0]["maxLength"] == MAX_ID_CHARS
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["maxItems"] == MAX_TOKEN_IDS
    assert schemas["ChatCompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["maxProperties"] == MAX_LOGIT_BIAS


def test_a_participant_name_is_any_text_within_its_bound(client):
    name = ("Dr. Ana Müller, reviewer " * 20)[:MAX_NAME_CHARS]
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=1,
                                            messages=[{"role": "user", "content": "Hi", "name": name}])
    assert answer.usage.completion_tokens == 1


# ---- JSON nested too deep -----------------------------------------------------------------------------


def test_a_body_nested_ten_thousand_deep_gets_a_400_saying_so_at_little_cost(http):
    body = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b', "max_tokens": 1}'
    start = time.monotonic()
    resp = http.post(C, content=body, headers={"content-type": "application/json"})
    seconds = time.monotonic() - start
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is None
    assert f"nests JSON arrays and objects more than {MAX_JSON_DEPTH} levels deep" in error["message"]
    assert seconds < 2.0, seconds
    assert http.get("/health").status_code == 200


def test_a_body_nested_within_the_bound_is_served(http):
    deep = {}
    for _ in range(MAX_JSON_DEPTH - 2):  # with the innermost object and the body's: MAX_JSON_DEPTH levels
        deep = {"a": deep}
    resp = http.post(CH, json=chat(prediction=deep))
    assert resp.status_code == 200, resp.text[:500]


def test_brackets_in_strings_do_not_count_as_nesting(http):
    resp = http.post("/tokenize", json={"prompt": "[" * 10_000})
    assert resp.status_code == 200, resp.text[:500]


def test_tool_call_arguments_nested_too_deep_get_a_400_naming_them(http):
    arguments = "[" * 10_000 + "]" * 10_000
    resp = http.post(CH, json=chat(messages=[{"role": "user", "content": "Hi"}, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                             "function": {"name": "f", "arguments": arguments}}]}]))
    assert resp.status_code == 400, resp.text[:500]
    assert resp.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_json_sent_as_text_is_held_to_the_bounds_of_a_body(http):
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "\\ud800"}'}}]
    resp = http.post(CH, json=chat(messages=[{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "tool_calls": calls}]))
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "unpaired UTF-16 surrogate" in error["message"]
    for schema, words in (('{"type": "string", "description": "\\ud800"}', "unpaired UTF-16 surrogate"),
                          ("[" * 1000 + "]" * 1000, f"more than {MAX_JSON_DEPTH} levels deep")):
        resp = http.post(C, json=completion(guided_json=schema))
        assert resp.status_code == 400, resp.text[:500]
        assert resp.json()["error"]["param"] == "guided_json" and words in resp.json()["error"]["message"]


# ---- unpaired surrogates --------------------------------------------------------------------------------

S = "\\ud800"  # an unpaired high surrogate, as JSON writes it
SURROGATES = [
    # (id, path, raw body, the field the 400 names)
    ("user", C, f'{{"prompt": "Hi", "user": "{S}"}}', "user"),
    ("tool-call-id", CH, f'{{"messages": [{{"role": "user", "content": "Hi"}}, {{"role": "tool", "content": "1", '
                         f'"tool_call_id": "a{S}"}}]}}', "messages.1.tool_call_id"),
    ("tool-call-id-of-a-call", CH, f'{{"messages": [{{"role": "assistant", "tool_calls": [{{"id": "{S}", '
                                   f'"function": {{"name": "f", "arguments": "{{}}"}}}}]}}]}}',
     "messages.0.tool_calls.0.id"),
    ("name", CH, f'{{"messages": [{{"role": "user", "content": "Hi", "name": "{S}"}}]}}', "messages.0.name"),
    ("content", CH, f'{{"messages": [{{"role": "user", "content": "{S}"}}]}}', "messages.0.content"),
    ("low-surrogate-alone", CH, '{"messages": [{"role": "user", "content": "\\udc00x"}]}', "messages.0.content"),
    ("metadata-value", CH, f'{{"messages": [{{"role": "user", "content": "Hi"}}], "metadata": {{"k": "{S}"}}}}',
     "metadata.k"),
    ("metadata-key", CH, f'{{"messages": [{{"role": "user", "content": "Hi"}}], "metadata": {{"a{S}": "v"}}}}',
     "metadata"),
    ("prediction", CH, f'{{"messages": [{{"role": "user", "content": "Hi"}}], "prediction": {{"a": [1, "{S}"]}}}}',
     "prediction"),
    ("tool-parameters", CH, f'{{"messages": [{{"role": "user", "content": "Hi"}}], "tool_choice": "none", '
                            f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": '
                            f'{{"type": "object", "description": "{S}"}}}}}}]}}', "tools.0.function.parameters"),
    ("stop-item", C, f'{{"prompt": "Hi", "stop": ["a", "{S}"]}}', "stop"),
    ("logit-bias-key", C, f'{{"prompt": "Hi", "logit_bias": {{"{S}": 1}}}}', "logit_bias"),
    ("guided-regex", C, f'{{"prompt": "Hi", "guided_regex": "{S}"}}', "guided_regex"),
    ("model", C, f'{{"prompt": "Hi", "model": "{S}"}}', "model"),
    ("tokenize-message", "/tokenize", f'{{"messages": [{{"role": "user", "content": "{S}"}}]}}',
     "messages.0.content"),
    ("responses-instructions", R, f'{{"input": "Hi", "instructions": "{S}"}}', "instructions"),
    ("responses-user", R, f'{{"input": "Hi", "user": "{S}"}}', "user"),
    ("responses-metadata", R, f'{{"input": "Hi", "metadata": {{"k": "{S}"}}}}', "metadata.k"),
    ("responses-input-part", R, f'{{"input": [{{"role": "user", "content": [{{"type": "input_text", '
                                f'"text": "{S}"}}]}}]}}', "input.0.content.0.text"),
]


@pytest.mark.parametrize("path,body,param", [case[1:] for case in SURROGATES], ids=[c[0] for c in SURROGATES])
def test_an_unpaired_surrogate_in_any_field_gets_a_400_naming_it(http, path, body, param):
    resp = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param or error["param"].startswith(param + "."), error  # a key: metadata.<key>
    assert "unpaired UTF-16 surrogate" in error["message"], error["message"]


def test_a_field_name_with_a_surrogate_gets_a_400_that_encodes(http):
    resp = http.post(C, content=f'{{"prompt": "Hi", "x{S}": 1}}'.encode(), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "unpaired UTF-16 surrogate" in resp.json()["error"]["message"]


def test_a_surrogate_pair_is_text(http):
    resp = http.post(C, content=b'{"prompt": "Hi \\ud83d\\ude00", "max_tokens": 1, "user": "\\ud83d\\ude00"}',
                     headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert http.get("/health").status_code == 200
