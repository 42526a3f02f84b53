"""Real ``pagoda serve`` processes sharing a KV connector folder: a second server answers a prompt the first
prefilled by loading its blocks, with the same greedy text as the first; ``pagoda kv-proxy`` prefills on one
instance and decodes on another, and when a decode instance is killed mid-stream the stream goes on on another
decode instance (the prompt's ids and the tokens already sent, as a continuation) and the client gets exactly the
greedy tokens of one engine alone, in float32, as one unbroken stream.

One set of processes for the module, on one shared-disk store: a server in both roles, a prefill instance, two
decode instances and the proxy in front of the prefill and decode instances. The tests run in file order: the
killed-mid-stream test kills the first decode instance, and the last test stops the prefill instance."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class Fleet:
    store: Path
    both: str  # a server in both roles (saves and loads)
    prefill: tuple[subprocess.Popen, str]
    decodes: list[tuple[subprocess.Popen, str]]
    proxy: str

    def live_decodes(self) -> list[str]:
        return [url for proc, url in self.decodes if proc.poll() is None]

    def down(self) -> list[str]:
        """The instances behind the proxy that are stopped, in the proxy's order."""
        return [url for proc, url in [self.prefill, *self.decodes] if proc.poll() is not None]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A tiny model's servers on one store folder (started side by side), and the proxy in front of the prefill
    and decode instances."""
    root = tmp_path_factory.mktemp("kv-serve")
    model = root / "model"
    model.mkdir()
    write_tiny_llama(model)
    store = root / "store"
    store.mkdir()
    flags = ("--model", str(model), "--kv-connector", "shared-disk", "--kv-connector-options",
             f'{{"path": "{store}"}}')
    roles = {"both": (), "prefill": ("--kv-role", "prefill"), "decode1": ("--kv-role", "decode"),
             "decode2": ("--kv-role", "decode")}
    procs: list[subprocess.Popen] = []
    try:
        with ThreadPoolExecutor(len(roles)) as pool:
            futures = {name: pool.submit(serve_process.start_server, root / f"{name}.log", *flags, *role_flags,
                                         kv_cache_bytes=16 << 20) for name, role_flags in roles.items()}
            started = {}
            for name, future in futures.items():
                try:
                    started[name] = future.result()
                    procs.append(started[name][0])
                except BaseException:
                    for other in futures.values():  # the others are stopped with this fixture's processes
                        if other is not future and other.exception() is None:
                            procs.append(other.result()[0])
                    raise
        decodes = [started["decode1"], started["decode2"]]
        proxy, proxy_url = serve_process.start_process(
            root / "proxy.log", "kv-proxy", "--prefill", started["prefill"][1], "--decode",
            *(url for _, url in decodes), timeout=60)
        procs.append(proxy)
        yield Fleet(store, started["both"][1], started["prefill"], decodes, proxy_url)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(60)


def test_a_second_server_loads_what_the_first_prefilled_and_answers_the_same(fleet):
    url_a, url_b, store = fleet.both, fleet.decodes[1][1], fleet.store
    loaded_before = metric(url_b, "kv_connector_blocks_loaded")
    prompt = "The shared prefix of a long conversation, " * 12
    answers = []
    for url in (url_a, url_b):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        done = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                         temperature=0.0)
        answers.append((done.choices[0].text, done.usage))
        if url == url_a:  # the first server's saves are written off the step: wait for its files
            deadline = time.monotonic() + 30
            while metric(url_a, "kv_connector_blocks_saved") < done.usage.prompt_tokens // 16:
                assert time.monotonic() < deadline, "the first server saved no blocks"
                time.sleep(0.1)
    (text_a, usage_a), (text_b, usage_b) = answers
    assert text_b == text_a and text_a
    loaded = metric(url_b, "kv_connector_blocks_loaded") - loaded_before
    assert loaded == (usage_b.prompt_tokens - 1) // 16 > 0
    assert metric(url_b, "kv_connector_blocks_failed") == 0
    assert metric(url_a, "kv_connector_blocks_loaded") == 0
    assert len(list(store.glob("*.kvc"))) == usage_a.prompt_tokens // 16


def test_a_decode_instance_killed_mid_stream_is_replaced_and_the_tokens_are_one_engine_s(fleet):
    """(Kills the first decode instance.)"""
    (decode1, decode1_url), (_, decode2_url) = fleet.decodes
    alone = openai.OpenAI(base_url=fleet.prefill[1] + "/v1", api_key="none")  # one engine, no connector reads
    client = openai.OpenAI(base_url=fleet.proxy + "/v1", api_key="none", max_retries=0)
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
    assert httpx.get(fleet.proxy + "/health", timeout=30).json()["down"] == [decode1_url]
    assert client.models.list().data[0].id == name  # (asked of the live decode instance)

    # later requests go to the live instance, whole (the dead one refuses connections: the next is tried)
    again = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in again if c.choices) == alone.completions.create(
        model=name, prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text
    # an answer not streamed whose turn falls on the dead instance is asked of the live one
    whole = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0)
    assert whole.choices[0].text == alone.completions.create(
        model=name, prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text


def test_the_proxy_prefills_on_one_instance_and_decodes_on_the_other_with_one_engine_s_tokens(fleet):
    """(Last in this file: it stops the prefill instance. The decode instances still up share the requests.)"""
    prefill, proxy, store = fleet.prefill, fleet.proxy, fleet.store
    decodes = fleet.live_decodes()
    # (the first test's prompt was loaded by a decode instance too)
    loaded_before = sum(metric(url, "kv_connector_blocks_loaded") for url in decodes)
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="none")
    direct = openai.OpenAI(base_url=prefill[1] + "/v1", api_key="none")  # one engine alone, no connector reads
    name = client.models.list().data[0].id
    prompt = "A long system prompt that both instances see the same way, " * 10
    via_proxy = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0.0)
    other = "Tell me about the shared store, and how the blocks get there. " * 8
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=name, prompt=other, max_tokens=16, temperature=0.0, stream=True) if chunk.choices)
    alone = direct.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0.0)
    alone_other = direct.completions.create(model=name, prompt=other, max_tokens=16, temperature=0.0)
    assert via_proxy.choices[0].text == alone.choices[0].text
    assert via_proxy.usage.completion_tokens == 16
    assert streamed == alone_other.choices[0].text and streamed
    # the decode instances loaded every full prompt block of both requests and computed none of them
    expected = (via_proxy.usage.prompt_tokens - 1) // 16 + (alone_other.usage.prompt_tokens - 1) // 16
    assert sum(metric(url, "kv_connector_blocks_loaded") for url in decodes) - loaded_before == expected
    assert all(metric(url, "kv_connector_blocks_saved") == 0 for url in decodes)
    assert metric(prefill[1], "kv_connector_lookups") == 0

    # a prefill instance that is gone costs the decode instance the prompt, not the request
    third = "A prompt the prefill instance never sees, since it stops first. " * 6
    alone_third = direct.completions.create(model=name, prompt=third, max_tokens=16, temperature=0.0)
    prefill[0].terminate()
    prefill[0].wait(60)
    for path in store.glob("*.kvc"):  # (the direct answer saved the prompt's blocks: the decode must compute)
        path.unlink()
    health = httpx.get(proxy + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["down"] == fleet.down() and prefill[1] in fleet.down()
    via_proxy = client.completions.create(model=name, prompt=third, max_tokens=16, temperature=0.0)
    assert via_proxy.choices[0].text == alone_third.choices[0].text
    # nothing more loaded
    assert sum(metric(url, "kv_connector_blocks_loaded") for url in decodes) - loaded_before == expected


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
