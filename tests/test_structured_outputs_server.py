"""Structured outputs over HTTP: a real uvicorn server on 127.0.0.1 over the default model, driven by the
official ``openai`` client (``.parse`` with a pydantic model, ``json_object``, streaming) and by LangChain; and a
server built from ``pagoda serve``'s flags with n-gram speculation."""

from __future__ import annotations

import gc
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app

API_KEY = "sk-pagoda-test"
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a cat as JSON."}]
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                        "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
       "required": ["name", "lives"], "additionalProperties": False}


class Cat(BaseModel):
    name: str = Field(max_length=10)
    lives: int = Field(ge=1, le=9)


class OneServer:
    """The server of each kind, at most one running: asking for the other kind stops the one started before and
    shuts its engine down (the tests are ordered by the server they use), and the last is stopped at the module's
    end, so the module holds one copy of the default model at a time and leaves nothing behind."""

    def __init__(self) -> None:
        self.kind, self.srv, self.engine = None, None, None

    def get(self, kind: str) -> ServerThread:
        if kind != self.kind:
            self.close()
            self.engine = plain_engine() if kind == "plain" else speculative_engine()
            self.srv = ServerThread(build_app(AsyncLLMEngine(self.engine), api_key=API_KEY)).start()
            self.kind = kind
        return self.srv

    def close(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.engine.shutdown()
        self.kind, self.srv, self.engine = None, None, None
        gc.collect()


@pytest.fixture(scope="module")
def servers():
    servers = OneServer()
    yield servers
    servers.close()


def plain_engine():
    ensure_default_model()
    return LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, kv_cache_memory_bytes=128 << 20).engine


@pytest.fixture
def server(servers):
    return servers.get("plain")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_the_parse_helper_gets_an_instance_of_its_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Cat, temperature=0,
                                               max_completion_tokens=60)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Cat)


def test_json_object_gives_a_json_object(client):
    # any object: its end is the model's choice, which greedy decoding makes here
    ask = [{"role": "user", "content": 'Reply with a JSON object: {"answer": ...}. What is 2 + 2?'}]
    completion = client.chat.completions.create(model=MODEL, messages=ask, response_format={"type": "json_object"},
                                                temperature=0, max_tokens=60)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_a_streamed_answer_to_a_json_schema_validates_once_joined(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0.7,
                                                 seed=1, max_tokens=60, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), CAT)


def test_text_response_format_leaves_the_output_free(client):
    completion = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "text"},
                                                temperature=0, max_tokens=5)
    assert completion.choices[0].finish_reason == "length"


def test_an_invalid_schema_is_a_400_naming_the_field(client):
    bad = {"type": "object", "properties": {"lives": {"type": "integer", "minimum": "one"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "cat", "schema": bad}})
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "response_format.json_schema.schema is not a valid JSON schema" in error["message"]
    assert "'one' is not of type 'number'" in error["message"]


def test_a_regex_that_does_not_compile_is_a_400_naming_the_vllm_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "[0-9"})
    assert info.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(a"}})
    assert info.value.body["param"] == "structured_outputs.regex"


def test_two_constraints_in_one_request_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="only one"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, response_format={"type": "json_object"},
                                       extra_body={"guided_choice": ["a", "b"]})


def test_vllm_fields_constrain_completions_and_chat(client):
    regex = r"[0-9]{3}-[0-9]{4}"
    out = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(regex, out.choices[0].text)
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=1.0, seed=2,
                                    extra_body={"guided_choice": ["blue", "green"]})
    assert out.choices[0].text in ("blue", "green")
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                         extra_body={"guided_json": CAT, "guided_decoding_backend": "guidance"})
    jsonschema.validate(json.loads(out.choices[0].message.content), CAT)
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                         extra_body={"structured_outputs": {"grammar": 'root ::= "meow" ("!")?'}})
    assert out.choices[0].message.content in ("meow", "meow!")


def test_a_streamed_completion_follows_guided_regex(client):
    regex = r"(yes|no), because [a-z ]{5,20}\."
    chunks = list(client.completions.create(model=MODEL, prompt="Is water wet?", max_tokens=40, temperature=0,
                                            stream=True, extra_body={"guided_regex": regex}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(regex, text), text


def test_langchain_with_structured_output_gets_the_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model=MODEL,
                                       temperature=0, max_tokens=60, max_retries=0)
    cat = chat.with_structured_output(Cat, method="json_schema").invoke("Describe a cat as JSON.")
    assert isinstance(cat, Cat)


def speculative_engine():
    """The engine ``pagoda serve`` builds from its flags, with n-gram speculation (``--speculative-config``)."""
    import argparse

    from pagoda.cli import engine_args_from
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.plugins.entrypoints.cli.serve import register
    from pagoda.registry.plugin_manager import PluginManager

    ensure_default_model()
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--dtype", "bfloat16", "--batch-invariant",
                            "--cpu-threads", "1", "--kv-cache-memory-bytes",
                            str(128 << 20), "--speculative-config", json.dumps(
                                {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})])
    engine = LLMEngine.from_engine_args(engine_args_from(ns), PluginManager().load())
    assert engine.config.speculative.method == "ngram"
    return engine


@pytest.fixture
def speculative_server(servers):
    return servers.get("speculative")


def test_a_speculative_server_holds_chat_and_completions_to_their_constraints(speculative_server):
    client = openai.OpenAI(base_url=speculative_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    cat = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Cat, temperature=0,
                                        max_tokens=60).choices[0].message.parsed
    assert isinstance(cat, Cat)
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.0, seed=3, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), CAT)
    # the prompt repeats itself, so the n-gram proposer drafts its words, which the regex forbids
    regex = "[0-9]{12}"
    done = client.completions.create(model=MODEL, prompt="red green blue red green blue red green blue red green",
                                     max_tokens=20, temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    assert done.choices[0].finish_reason == "stop" and re.fullmatch(regex, done.choices[0].text), done.choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt="Pick a city:", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"guided_choice": ["Paris", "Rome"]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("Paris", "Rome")
    metrics = httpx.get(speculative_server.url + "/metrics").text
    counters = {name: float(value) for name, value in re.findall(
        r"^pagoda:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens)_total\{[^}]*\} (\S+)$", metrics,
        re.MULTILINE)}
    assert counters["num_drafts"] > 0
    assert counters["num_accepted_tokens"] < counters["num_draft_tokens"] <= 4 * counters["num_drafts"]
