"""What one client can do to another's stored responses and to the server's reading of bodies: a stored
response belongs to the API key (or tenant) that stored it, GET and DELETE of another's id are 404s, one owner
storing many responses evicts only its own; a body declared in another charset than UTF-8 is a 415, and a
UTF-8 body with a byte-order mark is read (RFC 8259 lets a parser ignore it).

One real uvicorn server over the real default model, with room for 20 stored responses (2 per owner).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="bfloat16", batch_invariant=True,
              cpu_threads=1, max_model_len=256, max_num_seqs=2, kv_cache_memory_bytes=16 << 20,
              served_model_name=MODEL)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), max_stored_responses=20)).start()
    yield srv
    srv.stop()


def client_of(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_stored_response_is_its_owner_s_alone(server):
    alice, bob = client_of(server, "alice"), client_of(server, "bob")
    first = alice.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert alice.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        bob.responses.create(model=MODEL, input="and?", max_output_tokens=3, previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"
    assert alice.responses.create(model=MODEL, input="and?", max_output_tokens=3, previous_response_id=first.id)
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


def test_one_owner_storing_many_responses_does_not_evict_another_s(server):
    carol, mallory = client_of(server, "carol"), client_of(server, "mallory")
    kept = carol.responses.create(model=MODEL, input="remember", max_output_tokens=2)
    for _ in range(5):
        mallory.responses.create(model=MODEL, input="flood", max_output_tokens=1)
    assert carol.responses.retrieve(kept.id).id == kept.id


def test_a_body_declared_in_another_charset_is_a_415_and_a_utf8_byte_order_mark_is_read(server):
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", content=body.encode("utf-16"),
                      headers={"content-type": "application/json; charset=utf-16"})
        assert r.status_code == 415 and "UTF-8" in r.json()["error"]["message"]
        r = http.post("/v1/completions", content=b"\xef\xbb\xbf" + body.encode(),
                      headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
