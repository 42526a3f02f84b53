"""``pagoda serve --replicas 2 --replica-roles prefill,decode`` as users run it: a prefill and a decode replica on Ray
Serve sharing a ``shared-disk`` KV connector folder, driven by the official ``openai`` client. Every prompt is
computed on the prefill replica and loaded by the decode replica, and the answers (plain, streamed, chat) are the
greedy tokens of one engine alone in float32."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.plugins.entrypoints.server import free_port

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

PAGODA = str(Path(sys.executable).with_name("pagoda"))
MODEL = "tiny-llama"
BLOCK = 16


def start_roles(log: Path, model: Path, store: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [PAGODA, "serve", "--port", str(port), "--model", str(model), "--served-model-name", MODEL, "--dtype",
             "float32", "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "512", "--replicas", "2",
             "--replica-roles", "prefill,decode", "--kv-connector", "shared-disk", "--kv-connector-options",
             json.dumps({"path": str(store)})],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if "Application 'pagoda' is ready" in log.read_text():
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pagoda serve --replica-roles prefill,decode did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """replica -> {metric name: value} of the fleet page's kv_connector counters, and the router's own."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name.startswith("pagoda:kv_connector_") and s.name.endswith("_total"):
                out.setdefault(s.labels["replica"], {})[s.name[len("pagoda:"):-len("_total")]] = s.value
            elif s.name == "pagoda:router_prefill_failures_total":
                out.setdefault("router", {})["prefill_failures"] = s.value
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from tiny_models import write_tiny_llama

    from pagoda.modeling.default_model import ensure_default_model

    root = tmp_path_factory.mktemp("replica-roles")
    model = root / "model"
    model.mkdir()
    write_tiny_llama(model)
    shutil.copy(ensure_default_model() / "chat_template.jinja", model / "chat_template.jinja")
    store = root / "store"
    store.mkdir()
    proc, url = start_roles(root / "serve.log", model, store)
    try:
        yield url, model, store
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def one_engine_tokens(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The greedy tokens of one engine alone, no connector, in float32."""
    from one_engine import release
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="float32", kv_cache_memory_bytes=16 << 20, cpu_threads=1)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        release(llm)


def test_prefill_on_one_replica_decode_on_the_other_gives_one_engine_s_tokens(fleet):
    url, model, store = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    prompt = "A long system prompt that the prefill replica computes and the decode replica loads, " * 6
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                      extra_body=extra)
    whole = raw.parse()
    decode_name, prefill_name = raw.headers["x-pagoda-replica"], raw.headers["x-pagoda-prefill-replica"]
    assert decode_name != prefill_name

    other = "Tell me about the shared store, and how the blocks get from one replica to the other. " * 5
    streamed_prompt, streamed = None, []
    for chunk in client.completions.create(model=MODEL, prompt=other, max_tokens=12, temperature=0, stream=True,
                                           extra_body=extra):
        for choice in chunk.choices:
            streamed_prompt = streamed_prompt or choice.model_extra.get("prompt_token_ids")
            streamed += choice.model_extra.get("token_ids") or []

    messages = [{"role": "system", "content": "You answer from the shared store. " * 12},
                {"role": "user", "content": "Which replica computed my prompt?"}]
    chat_prompt, chat = None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                stream=True, extra_body=extra):
        chat_prompt = chat_prompt or (chunk.model_extra or {}).get("prompt_token_ids")
        for choice in chunk.choices:
            chat += choice.model_extra.get("token_ids") or []

    prompts = [whole.choices[0].model_extra["prompt_token_ids"], streamed_prompt, chat_prompt]
    assert all(prompts), prompts
    expected = one_engine_tokens(model, prompts, 12)
    assert [whole.choices[0].model_extra["token_ids"], streamed, chat] == expected

    # the prefill replica computed and saved every full prompt block; the decode replica loaded them all and
    # computed only each prompt's last, partial block (and its last token when the prompt fills its blocks)
    metrics = replica_metrics(url)
    prefill, decode = metrics[prefill_name], metrics[decode_name]
    assert prefill["kv_connector_blocks_saved"] == sum(len(p) // BLOCK for p in prompts)
    assert prefill.get("kv_connector_blocks_loaded", 0) == 0 and prefill.get("kv_connector_lookups", 0) == 0
    assert decode["kv_connector_blocks_loaded"] == sum((len(p) - 1) // BLOCK for p in prompts)
    assert decode.get("kv_connector_blocks_saved", 0) == 0 and decode.get("kv_connector_blocks_failed", 0) == 0
    assert metrics["router"]["prefill_failures"] == 0
    assert len(list(store.glob("*.kvc"))) == prefill["kv_connector_blocks_saved"]


def test_a_request_the_prefill_replica_refuses_gets_its_error_and_the_decode_replica_never_sees_it(fleet):
    url, _, _ = fleet
    loaded_before = {name: m.get("kv_connector_blocks_loaded", 0) for name, m in replica_metrics(url).items()}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello there, " * 20, max_tokens=4, temperature=-1.0)
    assert "temperature" in str(err.value)
    # and the next request is served as usual
    done = client.completions.create(model=MODEL, prompt="Hello there, " * 20, max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
    loaded = {name: m.get("kv_connector_blocks_loaded", 0) for name, m in replica_metrics(url).items()}
    assert sum(loaded.values()) - sum(loaded_before.values()) == (done.usage.prompt_tokens - 1) // BLOCK


def test_bad_replica_role_flags_fail_before_anything_starts(capsys):
    import ray

    from pagoda.cli import main

    cases = ((["--replicas", "2", "--replica-roles", "prefill,encode"], "unknown replica roles ['encode']"),
             (["--replicas", "3", "--replica-roles", "prefill,decode"], "names 2 roles for --replicas 3"),
             (["--replicas", "2", "--replica-roles", "decode,decode"], "at least one prefill and one decode"),
             (["--replicas", "2", "--replica-roles", "prefill,decode"], "add --kv-connector shared-disk"),
             (["--replicas", "2", "--replica-roles", "prefill,decode", "--kv-connector", "shared-disk",
               "--kv-role", "decode"], "drop --kv-role"),
             (["--replicas", "2", "--replica-roles", "prefill,decode", "--kv-connector", "shared-disk",
               "--max-replicas", "4"], "drop --max-replicas"))
    try:
        for flags, message in cases:
            try:
                assert main(["serve", *flags]) != 0
            except SystemExit as exc:  # argparse's refusal of a bad role
                assert exc.code != 0
            stderr = capsys.readouterr().err
            assert message in stderr, (flags, stderr[-2000:])
            assert not ray.is_initialized(), flags
    finally:
        ray.shutdown()


def test_a_serve_config_with_roles_needs_a_kv_connector(tmp_path):
    from tiny_models import write_tiny_checkpoint

    from pagoda.plugins.entrypoints.replicas.deployments import app_builder

    model = write_tiny_checkpoint(tmp_path / "model")
    engine = {"model": str(model), "load_format": "dummy"}
    with pytest.raises(ValueError, match="through a KV connector"):
        app_builder({"engine": engine, "replicas": {"roles": ["prefill", "decode"]}})
    # with one, the application has a prefill and a decode deployment behind the ingress
    app = app_builder({"engine": {**engine, "kv_connector": "shared-disk",
                                  "kv_connector_options": {"path": str(tmp_path)}},
                       "replicas": {"roles": ["prefill", "decode", "decode"]}})
    engines = {}
    for arg in app._bound_deployment.init_args:  # the engine deployments bound into the ingress
        deployment = getattr(arg, "_bound_deployment", None)
        if deployment is not None:
            engines[deployment.name] = (deployment.num_replicas, deployment.init_args[0].kv_role)
    assert engines == {"pagoda-decode": (2, "decode"), "pagoda-prefill": (1, "prefill")}
