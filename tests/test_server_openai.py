"""The OpenAI-compatible server on 127.0.0.1, driven by the official ``openai`` client.

One real uvicorn server over the real default model (bf16 in the batch-invariant
mode, so greedy tokens are exact whatever else the server batches) serves the whole module; offline references come from the same
engine before the server takes it over.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from engine_helpers import wait_until_cache_is_free
from leaving_client import post_and_leave_while_running

API_KEY = "sk-pagoda-test"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
COUNTING = "1, 2, 3, 4,"
# 8 distinct prompts, each sent 8 times by the concurrency test
CONCURRENT_PROMPTS = [f"Fact number {i}: the" for i in range(4)] + [f"def f{i}(x):" for i in range(4)]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True,
               cpu_threads=1, kv_cache_memory_bytes=128 << 20, disable_log_stats=False)  # /metrics


@pytest.fixture(scope="module")
def offline(llm):
    """Offline LLM results, computed one request at a time before the server owns the engine."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    ref = {
        "completion": llm.generate(PROMPT, greedy, use_tqdm=False)[0],
        "chat": llm.chat(CHAT, greedy, use_tqdm=False)[0],
        "stop": llm.generate(COUNTING, SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]), use_tqdm=False)[0],
        "seeded": llm.generate(PROMPT, SamplingParams(temperature=0.9, n=2, seed=1234, max_tokens=10),
                               use_tqdm=False)[0],
        "logprobs": llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0],
        "one_by_one": {p: llm.generate(p, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
                       .outputs[0].text for p in CONCURRENT_PROMPTS},
    }
    return ref


class EchoRoutes:
    """A third-party plugin adding a route through the same hook the OpenAI routes use."""

    @hookimpl
    def pagoda_add_routes(self, app, engine):
        @app.get("/v1/plugin/echo")
        async def echo():
            return {"model": engine.model_name, "healthy": engine.is_healthy}


@pytest.fixture(scope="module")
def server(llm, offline):
    llm.engine.pm.register(EchoRoutes(), name="echo-routes")
    aengine = AsyncLLMEngine(llm.engine)
    srv = ServerThread(build_app(aengine, api_key=API_KEY)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_completion_returns_the_offline_greedy_text_and_usage(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = offline["completion"]
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 12


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client):
    # 40 distinct words: more than two 16-token blocks, so a repeat finds whole blocks cached
    prompt = " ".join(f"word{i}" for i in range(40))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    usage = list(again)[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens == first.usage.prompt_tokens
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, temperature=0)
    resp = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, temperature=0)
    assert 0 < resp.usage.prompt_tokens_details.cached_tokens < resp.usage.prompt_tokens


def test_streamed_completion_text_equals_offline_generate(client, offline):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline["completion"].outputs[0].text
    assert sum(1 for c in chunks if c.choices) > 3  # streamed as produced, not in one piece
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_completion_streamed_and_not_equals_offline_chat(client, offline):
    want = offline["chat"].outputs[0].text
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert resp.choices[0].message.content == want and resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == offline["chat"].outputs[0].finish_reason


def test_stop_string_ends_the_text_before_it_streamed_and_not(client, offline):
    ref = offline["stop"].outputs[0]
    assert ref.finish_reason == "stop"
    resp = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=20, temperature=0, stop=[" 7"])
    assert resp.choices[0].text == ref.text and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=20, temperature=0, stop=[" 7"],
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref.text


def test_n_greater_than_one_with_a_seed_returns_the_offline_sequences(client, offline):
    want = [c.text for c in offline["seeded"].outputs]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, n=2, seed=1234)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == want
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, n=2, seed=1234,
                                       stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == want


def test_completion_logprobs_match_the_engine_and_chat_top_logprobs_are_ranked(client, offline):
    ref = offline["logprobs"].outputs[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    want = [entry[t].logprob for t, entry in zip(ref.token_ids, ref.logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert "".join(lp.tokens) == ref.text
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token


def test_sixty_four_concurrent_streams_all_match_running_them_one_by_one(server, offline):
    prompts = CONCURRENT_PROMPTS * 8
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    texts = asyncio.run(main())
    assert texts == [offline["one_by_one"][p] for p in prompts]


def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(server, llm):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            assert llm.engine.kv_manager.num_free_blocks < llm.engine.num_blocks  # it holds blocks now
    assert wait_until_cache_is_free(llm)


def test_a_non_streaming_client_that_gives_up_frees_its_kv_blocks(server, llm):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True}
    post_and_leave_while_running(llm, server.url + "/v1/completions", body,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    assert wait_until_cache_is_free(llm)


def test_a_missing_or_wrong_api_key_gets_401_but_probes_need_none(server):
    for headers in ({}, {"Authorization": "Bearer sk-pagoda-tesX"}, {"Authorization": API_KEY}):
        for path in ("/v1/models", "/v1/plugin/echo"):
            resp = httpx.get(server.url + path, headers=headers)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200


def test_a_plugin_adds_routes_through_the_same_hook_as_the_builtin_server(server):
    resp = httpx.get(server.url + "/v1/plugin/echo", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.json() == {"model": MODEL, "healthy": True}


def test_an_unknown_model_name_gets_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=2)
    assert "gpt-5" in info.value.body["message"] and info.value.body["code"] == "model_not_found"


def test_models_version_tokenize_and_detokenize_endpoints(client, server, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # the model's name, never where its files lie on the server's disk
    [listed] = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
    assert listed["root"] == MODEL and "/" not in json.dumps(listed)
    assert httpx.get(server.url + "/version").json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=headers).json()
    assert tok["tokens"] == llm.get_tokenizer().encode(PROMPT) and tok["count"] == len(tok["tokens"])
    chat_tok = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, headers=headers).json()
    assert chat_tok["tokens"] == llm.apply_chat_template(CHAT)
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=headers)
    assert detok.json() == {"prompt": PROMPT}


def test_metrics_endpoint_exports_pagoda_metrics_that_count_served_requests(client, server):
    def scrape():
        text = httpx.get(server.url + "/metrics").text
        return {(s.name, s.labels.get("finished_reason"), s.labels.get("le")): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = scrape()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0)
    after = scrape()
    assert after[("pagoda:generation_tokens_total", None, None)] - before[("pagoda:generation_tokens_total", None, None)] == 7
    assert after[("pagoda:request_success_total", "length", None)] - before[("pagoda:request_success_total", "length", None)] == 1
    assert after[("pagoda:inter_token_latency_seconds_count", None, None)] - \
        before[("pagoda:inter_token_latency_seconds_count", None, None)] == 6
    for name in ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
                 "pagoda:prefix_cache_queries_total", "pagoda:prefix_cache_hits_total", "pagoda:num_preemptions_total",
                 "pagoda:prompt_tokens_total", "pagoda:time_to_first_token_seconds_count",
                 "pagoda:e2e_request_latency_seconds_count", "pagoda:request_queue_time_seconds_count"):
        assert (name, None, None) in after, name
    assert ("pagoda:time_to_first_token_seconds_bucket", None, "0.001") in after
