"""LoRA adapters through a real server on 127.0.0.1 and the official ``openai`` client: the adapter's name is the
request's ``model`` (completions and chat), ``/v1/models`` lists adapters under their base model, unknown names
are OpenAI's 404, and adapters are loaded and unloaded while the server runs. The references come from the same
engine, offline, before the server takes it over."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.lora import LoRAAdminOptions
from lora_helpers import make_adapter
from tiny_models import write_tiny_llama

PROMPT = [5, 17, 923, 4001, 77, 311]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MAX_ADAPTERS = 3  # "first" given at start, room for two more
ADMIN_KEY = "operator-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-llama-lora-server")
    write_tiny_llama(model_dir, seed=4)
    template = ensure_default_model() / "chat_template.jinja"
    if template.exists():  # the chat route needs the template
        shutil.copy(template, model_dir / "chat_template.jinja")
    root = tmp_path_factory.mktemp("server-adapters")
    first = make_adapter(model_dir, root / "first", seed=21, r=8, alpha=16)
    second = make_adapter(model_dir, root / "second", seed=22, r=4, alpha=8, targets=["q_proj", "v_proj", "up_proj"])
    llm = LLM(str(model_dir), served_model_name="tiny", dtype="float32", enable_lora=True,
              lora_modules=[f"first={first}"], max_loras=2, max_lora_rank=8, kv_cache_memory_bytes=8 << 20,
              cpu_threads=1)
    from pagoda import LoRARequest

    prompt = {"prompt_token_ids": PROMPT}
    refs = {name: llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for name, lora in (("tiny", None), ("first", llm.engine.loras["first"]),
                               ("second", LoRARequest("second-offline", 99, str(second))))}
    assert len(set(refs.values())) == 3, "the adapters must change the greedy text, or the test proves nothing"
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), allow_runtime_lora_updating=True,
                                 lora_admin=LoRAAdminOptions(max_adapters=MAX_ADAPTERS, admin_api_key=ADMIN_KEY))).start()
    yield srv, refs, second
    srv.stop()


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_the_adapter_name_as_model_gives_the_adapters_tokens_and_the_base_name_the_base_models(setup, client):
    _, refs, _ = setup
    assert complete(client, "first") == refs["first"]
    assert complete(client, "tiny") == refs["tiny"]


def test_streamed_and_chat_requests_take_the_adapter_too(setup, client):
    _, refs, _ = setup
    stream = client.completions.create(model="first", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.model for c in chunks} == {"first"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == refs["first"]
    chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0)
    assert chat.model == "first" and chat.choices[0].message.content is not None


def test_models_lists_each_adapter_with_the_base_model_as_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"tiny", "first"}
    assert getattr(models["first"], "parent") == "tiny"
    assert getattr(models["tiny"], "parent", None) is None


def test_an_unknown_model_is_a_404_naming_the_served_models(client):
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "nope")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'nope' does not exist" in error["message"] and "'tiny'" in error["message"]
    assert "'first'" in error["message"]


def test_an_adapter_loaded_at_run_time_is_served_and_gone_once_unloaded(setup, client):
    srv, refs, second = setup
    with httpx.Client(base_url=srv.url, timeout=60, headers=ADMIN) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(second)})
        assert r.status_code == 200, r.text
        assert complete(client, "second") == refs["second"]
        assert "second" in {m.id for m in client.models.list().data}

        again = http.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(second)})
        assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(second) + "-missing"})
        assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]

        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            complete(client, "second")
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert missing.status_code == 404
    assert complete(client, "first") == refs["first"]  # still serving


def test_models_names_no_path_of_the_server(setup):
    srv, _, second = setup
    text = httpx.get(srv.url + "/v1/models", timeout=30).text
    assert str(second.parent) not in text and "/tmp" not in text


def test_the_operator_routes_need_the_admin_key(setup):
    srv, _, second = setup
    for headers in ({}, {"authorization": "Bearer someone-else"}):
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(second)},
                       headers=headers, timeout=30)
        assert r.status_code == 401 and "--admin-api-key" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "first"}, timeout=30)
    assert r.status_code == 401


def test_paths_outside_the_allowed_roots_are_refused_without_saying_whether_they_exist(setup):
    srv, _, second = setup
    messages = set()
    with httpx.Client(base_url=srv.url, timeout=60, headers=ADMIN) as http:
        for path in ("/etc", "/nonexistent/adapter", "/proc/self", str(second) + "/../../..", "/etc/passwd"):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
            messages.add(r.json()["error"]["message"])
    assert len(messages) == 1 and "--lora-allowed-roots" in messages.pop()


def test_adapter_names_and_the_number_of_adapters_are_bounded(setup):
    srv, _, second = setup
    with httpx.Client(base_url=srv.url, timeout=60, headers=ADMIN) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "n" * (1 << 20), "lora_path": str(second)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        try:
            for i in range(MAX_ADAPTERS - 1):
                assert http.post("/v1/load_lora_adapter", json={"lora_name": f"extra{i}",
                                                                "lora_path": str(second)}).status_code == 200
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "one-too-many", "lora_path": str(second)})
            assert r.status_code == 400 and "--max-lora-adapters" in r.json()["error"]["message"]
        finally:
            for i in range(MAX_ADAPTERS - 1):
                http.post("/v1/unload_lora_adapter", json={"lora_name": f"extra{i}"})


def test_the_lora_requests_gauge_is_exported(setup):
    srv, _, _ = setup
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    assert 'pagoda:lora_requests_info{max_lora="2"' in text


def test_the_load_routes_are_absent_unless_runtime_updating_is_allowed(tmp_path):
    from tiny_models import tiny_llm, write_tiny_checkpoint

    llm = tiny_llm(write_tiny_checkpoint(tmp_path / "tiny"), enable_lora=True)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}, timeout=30)
        assert r.status_code == 404
    finally:
        srv.stop()
