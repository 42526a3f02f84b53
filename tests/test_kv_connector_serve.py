"""Real ``pagoda serve`` processes sharing a KV connector folder: a second server answers a prompt the first
prefilled by loading its blocks, with the same greedy text as the first; ``pagoda kv-proxy`` prefills on one
instance and decodes on another.

One set of processes for the module: a server in both roles, a prefill instance, a decode instance (the second
server of the first test, the decode side of the proxy in the second) and the proxy."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

import serve_process
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow


def start_server(log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    return serve_process.start_server(log, *flags, kv_cache_bytes=16 << 20)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"pagoda:{name}_total") or line.startswith(f"pagoda:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no pagoda:{name} on {url}/metrics")


def start_proxy(log: Path, prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    return serve_process.start_process(log, "kv-proxy", "--prefill", prefill, "--decode", decode, timeout=60)


@dataclass
class Fleet:
    store: Path
    both: str  # a server in both roles (saves and loads)
    prefill: tuple[subprocess.Popen, str]
    decode: str
    proxy: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A tiny model's servers on one store folder, and the proxy between the prefill and decode instances."""
    root = tmp_path_factory.mktemp("kv-serve")
    model = root / "model"
    model.mkdir()
    write_tiny_llama(model)
    store = root / "store"
    store.mkdir()
    flags = ("--model", str(model), "--kv-connector", "shared-disk", "--kv-connector-options",
             f'{{"path": "{store}"}}')
    procs = []
    try:
        both = start_server(root / "both.log", *flags)
        procs.append(both[0])
        prefill = start_server(root / "prefill.log", *flags, "--kv-role", "prefill")
        procs.append(prefill[0])
        decode = start_server(root / "decode.log", *flags, "--kv-role", "decode")
        procs.append(decode[0])
        proxy = start_proxy(root / "proxy.log", prefill[1], decode[1])
        procs.append(proxy[0])
        yield Fleet(store, both[1], prefill, decode[1], proxy[1])
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def test_a_second_server_loads_what_the_first_prefilled_and_answers_the_same(fleet):
    url_a, url_b, store = fleet.both, fleet.decode, fleet.store
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


def test_the_proxy_prefills_on_one_instance_and_decodes_on_the_other_with_one_engine_s_tokens(fleet):
    """(Last in this file: it stops the prefill instance.)"""
    prefill, decode, proxy, store = fleet.prefill, fleet.decode, fleet.proxy, fleet.store
    # (the first test's prompt was loaded by the decode instance too)
    loaded_before = metric(decode, "kv_connector_blocks_loaded")
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
    # the decode instance loaded every full prompt block of both requests and computed none of them
    expected = (via_proxy.usage.prompt_tokens - 1) // 16 + (alone_other.usage.prompt_tokens - 1) // 16
    assert metric(decode, "kv_connector_blocks_loaded") - loaded_before == expected
    assert metric(decode, "kv_connector_blocks_saved") == 0
    assert metric(prefill[1], "kv_connector_lookups") == 0

    # a prefill instance that is gone costs the decode instance the prompt, not the request
    third = "A prompt the prefill instance never sees, since it stops first. " * 6
    alone_third = direct.completions.create(model=name, prompt=third, max_tokens=16, temperature=0.0)
    prefill[0].terminate()
    prefill[0].wait(60)
    for path in store.glob("*.kvc"):  # (the direct answer saved the prompt's blocks: the decode must compute)
        path.unlink()
    assert httpx.get(proxy + "/health", timeout=30).status_code == 503
    via_proxy = client.completions.create(model=name, prompt=third, max_tokens=16, temperature=0.0)
    assert via_proxy.choices[0].text == alone_third.choices[0].text
    assert metric(decode, "kv_connector_blocks_loaded") - loaded_before == expected  # nothing more
