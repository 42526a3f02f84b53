"""What evaluation harnesses ask of the server, and OpenAI's request schemas in full, through the official client.

``echo`` with ``logprobs`` (and ``max_tokens: 0``) scores a prompt, streamed and not; vLLM's
``prompt_logprobs`` field; every field of OpenAI's completions and chat request schemas is accepted, the ones
pagoda ignores named in a header and logged once; paths pagoda does not serve answer 404 in OpenAI's shape.
One real uvicorn server over the real default model (bf16 in the batch-invariant mode) serves the module; the references come from
the same engine, offline, before the server takes it over.
"""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
OTHER = "One, two, three,"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
# OpenAI's deprecated function-calling fields, refused (tools and tool_choice replace them)
TOOL_FIELDS = {"functions", "function_call"}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def offline(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=2)
    return {p: llm.generate(p, greedy, use_tqdm=False)[0] for p in (PROMPT, OTHER)}


@pytest.fixture(scope="module")
def server(llm, offline):
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def prompt_logprob_values(ref) -> list[float]:
    """The offline logprob of each prompt token after the first."""
    return [entry[t].logprob for t, entry in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]


def assert_scores_the_prompt(lp, ref, num_top: int) -> None:
    """The first len(prompt) entries of a completions logprobs object are the prompt's, as the engine scored it."""
    n = len(ref.prompt_token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(prompt_logprob_values(ref), abs=1e-4)
    assert "".join(lp.tokens[:n]) == ref.prompt
    offsets = [0]
    for token in lp.tokens[:n - 1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset[:n] == offsets
    for token, logprob, top in zip(lp.tokens[1:n], lp.token_logprobs[1:n], lp.top_logprobs[1:n]):
        assert top[token] == pytest.approx(logprob) and len(top) <= num_top + 1


def test_echo_with_logprobs_and_max_tokens_zero_scores_the_prompt_alone(client, offline, llm):
    ref = offline[PROMPT]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ref.prompt_token_ids)
    assert_scores_the_prompt(choice.logprobs, ref, 1)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks  # its blocks were freed


def test_max_tokens_zero_without_echo_returns_an_empty_completion(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert resp.choices[0].text == "" and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(offline[PROMPT].prompt_token_ids)


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(client, offline):
    ref = offline[PROMPT]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0)
    choice, completion = resp.choices[0], ref.outputs[0]
    n = len(ref.prompt_token_ids)
    assert choice.text == PROMPT + completion.text
    lp = choice.logprobs
    assert_scores_the_prompt(lp, ref, 1)
    assert lp.token_logprobs[n:] == pytest.approx([e[t].logprob for t, e in zip(completion.token_ids,
                                                                                 completion.logprobs)], abs=1e-4)
    assert "".join(lp.tokens[n:]) == completion.text and lp.text_offset[n] == len(PROMPT)
    # echo without logprobs: the text only
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    assert plain.choices[0].text == PROMPT + completion.text and plain.choices[0].logprobs is None


def test_a_batch_of_token_id_prompts_is_scored_as_lm_eval_sends_it(client, offline):
    refs = [offline[PROMPT], offline[OTHER]]
    resp = client.completions.create(model=MODEL, prompt=[r.prompt_token_ids for r in refs], echo=True, logprobs=1,
                                     max_tokens=1, temperature=0, seed=1234)
    choices = sorted(resp.choices, key=lambda c: c.index)
    for choice, ref in zip(choices, refs):
        first = ref.outputs[0]
        assert choice.text.startswith(ref.prompt) and len(choice.logprobs.tokens) == len(ref.prompt_token_ids) + 1
        assert_scores_the_prompt(choice.logprobs, ref, 1)
        want = first.logprobs[0][first.token_ids[0]].logprob
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(want, abs=1e-4)


def test_a_streamed_echo_sends_the_prompt_and_its_logprobs_in_the_first_chunk(client, offline):
    ref = offline[PROMPT]
    n = len(ref.prompt_token_ids)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4,
                                       temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) >= n
    assert_scores_the_prompt(first.logprobs, ref, 1)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + ref.outputs[0].text
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets[n] == len(PROMPT) and offsets == sorted(offsets)
    scored = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                            stream=True))
    assert scored[0].choices[0].text == PROMPT and scored[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_answers_in_vllm_s_shape_for_completions_and_chat(client, offline, llm):
    ref = offline[PROMPT]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    prompt_logprobs = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ref.prompt_token_ids) and prompt_logprobs[0] is None
    for token_id, entry, want in zip(ref.prompt_token_ids[1:], prompt_logprobs[1:], prompt_logprob_values(ref)):
        assert entry[str(token_id)]["logprob"] == pytest.approx(want, abs=1e-4)
        assert {r["rank"] for r in entry.values()} >= {1, 2} and len(entry) <= 3
        assert all(set(r) == {"logprob", "rank", "decoded_token"} for r in entry.values())
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0, extra_body={"prompt_logprobs": 0})
    prompt_ids = llm.apply_chat_template(CHAT)
    chat_logprobs = chat.model_extra["prompt_logprobs"]
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "length"
    assert len(chat_logprobs) == len(prompt_ids) and chat_logprobs[0] is None
    assert all(str(t) in entry for t, entry in zip(prompt_ids[1:], chat_logprobs[1:]))


def test_every_openai_request_field_is_a_field_of_the_server_s_request_models():
    # the installed openai package's request schemas; tool calling is another part's
    completion_fields = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    chat_fields = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
    assert completion_fields - set(CompletionRequest.model_fields) == set()
    assert chat_fields - TOOL_FIELDS - set(ChatCompletionRequest.model_fields) == set()


def test_ignored_openai_fields_are_named_in_a_header_and_logged_once_each(client, caplog):
    ignored = {"store": True, "metadata": {"run": "eval"}, "service_tier": "auto",
               "prediction": {"type": "content", "content": "4"}, "modalities": ["text"], "reasoning_effort": "low",
               "web_search_options": {}, "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "s"}
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    with caplog.at_level(logging.WARNING, logger="pagoda.server"):
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_completion_tokens=3,
                                                                   temperature=0, seed=7, user="u-1", **ignored,
                                                                   extra_body={"frobnicate": 1})
            # a field of no schema is ignored and named too (--strict-request-fields refuses it)
            assert raw.headers["x-pagoda-ignored-fields"].split(", ") == [*ignored, "frobnicate"]
            resp = raw.parse()
            assert resp.choices[0].message.content == plain.choices[0].message.content
            assert resp.usage.completion_tokens == 3
    warned = [r.getMessage() for r in caplog.records if "has no effect in pagoda" in r.getMessage()]
    assert len(warned) == len(ignored)  # once per field name, not once per request
    assert all(any(repr(name) in message for message in warned) for name in ignored)
    without = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert "x-pagoda-ignored-fields" not in without.headers
    stream = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                                         stream_options={"include_usage": True,
                                                                         "include_obfuscation": True})
    assert stream.headers["x-pagoda-ignored-fields"] == "stream_options.include_obfuscation"
    assert list(stream.parse())[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("method, path", [("POST", "/v1/embeddings"), ("POST", "/v1/audio/transcriptions"),
                                          ("POST", "/v1/images/generations"), ("GET", "/v1/files"),
                                          ("POST", "/v1/fine_tuning/jobs"), ("POST", "/v1/moderations"),
                                          ("GET", "/v2/nothing/here")])
def test_a_path_pagoda_does_not_serve_gets_404_in_openai_s_error_shape(server, method, path):
    resp = httpx.request(method, server.url + path, json={"model": MODEL, "input": "x"})
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert f"{method} {path} is not served by pagoda" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_official_client_sees_an_unserved_route_as_not_found(client):
    with pytest.raises(openai.NotFoundError, match="not served by pagoda"):
        client.embeddings.create(model=MODEL, input="hello")
