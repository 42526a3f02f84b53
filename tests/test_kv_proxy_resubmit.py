"""``pagoda kv-proxy`` when a decode instance is killed mid-stream: the stream goes on on another decode
instance (the prompt's ids and the tokens already sent, as a continuation) and the client gets exactly the greedy
tokens of one engine alone, in float32, as one unbroken stream.

Real processes on 127.0.0.1, one set for the module: a prefill instance, two decode instances on one shared-disk
store, and the proxy in front of them."""

from __future__ import annotations

import subprocess
import time

import httpx
import openai
import pytest

import serve_process
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow

NUM_TOKENS = 400  # long enough that the first decode instance is still streaming when it is killed


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"pagoda:{name}_total") or line.startswith(f"pagoda:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no pagoda:{name} on {url}/metrics")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-resubmit")
    model = root / "model"
    model.mkdir()
    write_tiny_llama(model)
    store = root / "store"
    store.mkdir()
    flags = ("--model", str(model), "--kv-connector", "shared-disk", "--kv-connector-options",
             f'{{"path": "{store}"}}')
    procs: list[subprocess.Popen] = []
    try:
        started = []
        for name, role in (("prefill", "prefill"), ("decode1", "decode"), ("decode2", "decode")):
            proc, url = serve_process.start_server(root / f"{name}.log", *flags, "--kv-role", role,
                                                   kv_cache_bytes=16 << 20)
            procs.append(proc)
            started.append((proc, url))
        proxy, proxy_url = serve_process.start_process(
            root / "proxy.log", "kv-proxy", "--prefill", started[0][1], "--decode", started[1][1], started[2][1],
            timeout=60)
        procs.append(proxy)
        yield started, proxy_url
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(60)


def test_a_decode_instance_killed_mid_stream_is_replaced_and_the_tokens_are_one_engine_s(fleet):
    (prefill, _), (decode1, decode1_url), (_, decode2_url) = fleet[0]
    proxy_url = fleet[1]
    alone = openai.OpenAI(base_url=prefill_url(fleet) + "/v1", api_key="none")  # one engine, no connector reads
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    prompt = "The decode instance goes away while it streams; the answer must not notice. " * 4
    options = dict(model=name, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0.0,
                   extra_body={"ignore_eos": True, "return_token_ids": True})
    reference = alone.completions.create(**options)
    expected_ids = reference.choices[0].model_extra["token_ids"]
    assert len(expected_ids) == NUM_TOKENS

    lookups_before = metric(decode2_url, "kv_connector_lookups")
    ids, text, usage, ids_when_killed = [], "", None, None
    prompt_ids = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **options):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.model_extra
            if prompt_ids is None and "prompt_token_ids" in extra:
                prompt_ids = extra["prompt_token_ids"]
            ids.extend(extra["token_ids"])
            text += choice.text
        if ids_when_killed is None and len(ids) >= 4:
            decode1.kill()  # the first decode instance dies mid-answer (its socket is cut)
            decode1.wait(30)
            ids_when_killed = len(ids)
    assert ids_when_killed is not None and ids_when_killed < NUM_TOKENS
    assert ids == expected_ids
    assert text == reference.choices[0].text
    assert prompt_ids == reference.choices[0].model_extra["prompt_token_ids"]
    assert usage.prompt_tokens == reference.usage.prompt_tokens
    assert usage.completion_tokens == NUM_TOKENS
    # the second decode instance took over, loading the prompt's blocks from the shared store
    assert metric(decode2_url, "kv_connector_lookups") > lookups_before
    assert httpx.get(proxy_url + "/health", timeout=30).json()["down"] == [decode1_url]

    # later requests go to the live instance, whole (the dead one refuses connections: the next is tried)
    again = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in again if c.choices) == alone.completions.create(
        model=name, prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text
    # an answer not streamed whose turn falls on the dead instance is asked of the live one
    whole = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0)
    assert whole.choices[0].text == alone.completions.create(
        model=name, prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text


def prefill_url(fleet) -> str:
    return fleet[0][0][1]


def test_a_chat_continuation_is_rewritten_as_the_first_stream_s_chat_deltas():
    """(No server: the proxy's rewriting of a completions continuation into the chat stream it continues.)"""
    import json

    from plugins.kv_connectors.proxy import Resumption, resumable

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5,
            "stream_options": {"include_usage": True}}
    assert resumable(body) and not resumable({**body, "n": 2}) and not resumable({**body, "logprobs": True})
    state = Resumption("/v1/chat/completions", body)
    first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
             "prompt_token_ids": [1, 2, 3],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None,
                          "token_ids": [10, 11]}]}
    out = json.loads(state.rewrite(b"data: " + json.dumps(first).encode())[len("data: "):])
    assert "prompt_token_ids" not in out and "token_ids" not in out["choices"][0]  # the client asked for none
    assert state.prompt_ids == [1, 2, 3] and state.sent_ids == [10, 11] and state.can_resume()
    state.next_segment()
    again = state.resume_body()
    assert again["prompt"] == [1, 2, 3, 10, 11] and again["max_tokens"] == 3 and "messages" not in again
    cont = {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "text": "b", "finish_reason": "length", "prompt_token_ids": [1, 2, 3, 10, 11],
                         "token_ids": [12, 13, 14]}]}
    out = json.loads(state.rewrite(b"data: " + json.dumps(cont).encode())[len("data: "):])
    assert out == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": "b"}, "logprobs": None,
                                "finish_reason": "length"}]}
    usage = {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    out = json.loads(state.rewrite(b"data: " + json.dumps(usage).encode())[len("data: "):])
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert state.finished and state.sent_ids == [10, 11, 12, 13, 14]
