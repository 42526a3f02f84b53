"""Everything that runs on a Ray cluster, on one local cluster of 2 CPUs started here (a cluster's start costs
seconds of CPU, Serve's more): ranks as Ray actors (``distributed_executor_backend="ray"``), then two launches of
``pagoda serve --replicas 2`` as users run them, each joining the cluster with ``--ray-address`` and adding its
application to the Serve already running on it (as an operator's cluster would have it), driven by the official
``openai`` client:

- prefix-aware routing, against power-of-two routing over two engines of the same model and pool in this process,
  sent the same requests the same way;
- ``--replica-roles prefill,decode``: a prefill and a decode replica sharing a ``shared-disk`` KV connector folder.
  Every prompt is computed on the prefill replica and loaded by the decode replica, and the answers (plain,
  streamed, chat) are the greedy tokens of one engine alone in float32.

The tests run in this order (the rank tests need the cluster's CPUs free of replicas; the roles launch stays up
until the module ends). The flags and the pieces of the replicas, with no cluster: test_replica_flags.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.plugins.entrypoints.server import free_port

import test_lora_tensor_parallel as lora_tp
import test_pipeline_parallel as pp
from test_pipeline_parallel import one_stage, three_layers  # noqa: F401 - the module fixtures, shared

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

# tiny random Llamas (tests/tiny_models.py): routing, prefix caching and KV hand-off work on token ids, whatever
# the weights
MODEL = "tiny-llama"
BLOCK = 16
# 3 prompt prefixes of 8 blocks, interleaved; each replica's KV pool holds about 2 of them, so a
# replica that is sent all 3 in turn keeps evicting them
NUM_GROUPS, NUM_ROUNDS, PREFIX_LEN = 3, 5, 8 * BLOCK
POOL_FLAGS = ("--num-gpu-blocks-override", "24", "--max-model-len", "256")


# --- ranks as Ray actors: the mp executor's tests (test_pipeline_parallel.py, test_tensor_parallel.py,
# test_lora_tensor_parallel.py) check the same mechanisms in depth; here the Ray executor runs each once. Each
# placement group is removed when its engine shuts down.

def all_removed(ray) -> bool:
    table = ray.util.placement_group_table()
    return bool(table) and all(group["state"] == "REMOVED" for group in table.values())


def test_ray_actors_as_stages_give_the_tokens_of_one(ray_cluster, three_layers, one_stage):
    worst = pp.assert_same_tokens(one_stage, pp.run(three_layers, pp=2, prompts=pp.TOKEN_PROMPTS,
                                                    distributed_executor_backend="ray", pipeline_micro_batches=2,
                                                    in_flight=2))
    assert worst < 1e-4
    assert all_removed(ray_cluster)


def test_ray_actors_as_ranks_give_one_rank_s_tokens_with_and_without_adapters(ray_cluster, tmp_path_factory):
    # the uneven tiny model (3 query heads on 1 KV head, MLP 99 wide), each prompt with the base model and with
    # two adapters (both in slots throughout: a Ray step costs a remote call per rank); the default model over two
    # ranks, and adapters moving between slots, are test_tensor_parallel.py's and test_lora_tensor_parallel.py's
    model_dir, loras = lora_tp.model_with_adapters(tmp_path_factory, "uneven")
    two = loras[:2]
    lora_tp.assert_same_tokens(lora_tp.generate(model_dir, two, 1),
                               lora_tp.generate(model_dir, two, 2, distributed_executor_backend="ray"), len(two))
    assert all_removed(ray_cluster)


# --- pagoda serve --replicas 2 on the cluster's Serve

@pytest.fixture(scope="module")
def serve_on_cluster(ray_cluster):
    """Ray Serve on the cluster (its controller and HTTP proxy started here, the pagoda checks in the controller's
    environment): the cluster's address and the proxy's port, for the launches to join."""
    from ray import serve

    from pagoda.plugins.entrypoints.replicas.command import controller_env

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                controller_options={"runtime_env": {"env_vars": controller_env()}})
    try:
        yield ray_cluster.get_runtime_context().gcs_address, port
    finally:
        serve.shutdown()


def launch(log: Path, model: Path, cluster: tuple[str, int], *flags: str) -> tuple[subprocess.Popen, str]:
    """``pagoda serve --replicas 2`` joining the cluster's Serve, once Serve says every replica has started (an
    engine replica answers before the other is up, and a workload sent then would all go to it)."""
    from serve_process import start_process

    address, port = cluster
    # this process's environment now: ray.init here has put the cluster's token in it
    return start_process(log, "serve", "--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                         "--replicas", "2", "--ray-address", address, *flags, timeout=300, port=port,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                         ready_line="Application 'pagoda' is ready")


def shared_prefix_prompts() -> list[tuple[int, list[int]]]:
    """(group, prompt token ids): each prompt is its group's prefix and one block of its own."""
    prompts = []
    for r in range(NUM_ROUNDS):
        for g in range(NUM_GROUPS):
            prefix = [1000 + 500 * g + i for i in range(PREFIX_LEN)]
            prompts.append((g, prefix + [5000 + 100 * r + 10 * g + i for i in range(BLOCK)]))
    return prompts


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run_workload(url: str) -> dict:
    """Send the shared-prefix prompts two at a time, streaming; where each went, what it found cached."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = shared_prefix_prompts()
    results: list[dict] = [{} for _ in prompts]
    queue = list(enumerate(prompts))

    async def worker():
        while queue:
            i, (group, prompt) = queue.pop(0)
            start = time.perf_counter()
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True})
            ttft, usage = None, None
            async for chunk in raw.parse():
                if chunk.choices and ttft is None:
                    ttft = time.perf_counter() - start
                usage = chunk.usage or usage
            results[i] = {"group": group, "replica": raw.headers["x-pagoda-replica"], "ttft": ttft,
                          "prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens}

    await asyncio.gather(worker(), worker())
    await client.close()
    holder: dict[int, str] = {}
    at_holder = later = 0
    for r in results:
        if r["group"] in holder:
            later += 1
            at_holder += r["replica"] == holder[r["group"]]
        else:
            holder[r["group"]] = r["replica"]
    ttfts = sorted(r["ttft"] for r in results)
    return {"to_holder": at_holder / later, "hit_rate": sum(r["cached"] for r in results) / sum(
        r["prompt"] for r in results), "ttft_p50": ttfts[len(ttfts) // 2], "ttft_p99": ttfts[-1],
        "replicas": {r["replica"] for r in results}}


def power_of_two_control(model: Path) -> dict:
    """The workload routed by the power-of-two router (seeded) over two engines built as the replicas are
    (same model, dtype and KV pool), two requests in flight at a time as the workload sends them, the load being
    the requests in flight on each: where each went and what it found cached, as :func:`run_workload` reports."""
    from pagoda.engine.engine_args import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.execution.routing import ReplicaLoad, RoutingRequest, make_router, prompt_block_hashes
    from pagoda.registry.plugin_manager import get_plugin_manager
    from pagoda.sampling_params import SamplingParams

    pm = get_plugin_manager()
    args = EngineArgs.build(model=str(model), dtype="float32", num_gpu_blocks_override=24, max_model_len=256,
                            cpu_threads=1)
    engines = [LLMEngine.from_engine_args(args, pm) for _ in range(2)]
    router = make_router("power-of-two", {"seed": 0}, pm)
    prompts = shared_prefix_prompts()
    queue = list(enumerate(prompts))
    in_flight: dict[str, int] = {}  # request id -> engine
    results: list[dict] = [{} for _ in prompts]
    try:
        while queue or in_flight:
            while queue and len(in_flight) < 2:
                i, (group, prompt) = queue.pop(0)
                request = RoutingRequest(str(i), tuple(prompt_block_hashes(prompt, BLOCK)), len(prompt))
                loads = [ReplicaLoad(e, list(in_flight.values()).count(e)) for e in range(2)]
                chosen = router.route(request, loads).replica_id
                router.on_routed(request, chosen)
                engines[chosen].add_request(str(i), {"prompt_token_ids": prompt},
                                            SamplingParams(max_tokens=4, temperature=0))
                in_flight[str(i)] = chosen
            for e in sorted(set(in_flight.values())):
                for out in engines[e].step():
                    if out.finished:
                        del in_flight[out.request_id]
                        results[int(out.request_id)] = {"group": prompts[int(out.request_id)][0], "replica": e,
                                                        "prompt": len(out.prompt_token_ids),
                                                        "cached": out.num_cached_tokens}
    finally:
        for engine in engines:
            engine.shutdown()
    return {"hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
            "replicas": {r["replica"] for r in results}}


@pytest.fixture(scope="module")
def routing_runs(serve_on_cluster, tmp_path_factory):
    """The workload through ``pagoda serve --replicas 2`` with prefix-aware routing and the fleet metrics page
    after it; the same workload routed by power-of-two over two engines in this process; and the address of
    the running Serve as a launch reads it. The launch deletes its application when stopped, leaving Serve up."""
    import gc

    from ray import serve

    from pagoda.plugins.entrypoints.replicas.command import running_serve_address
    from tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    runs = {"power-of-two": power_of_two_control(model)}
    gc.collect()  # (its engines gone before the replicas start)
    log = tmp_path_factory.mktemp("replicas") / "prefix-aware.log"
    proc, url = launch(log, model, serve_on_cluster, *POOL_FLAGS, "--router", "prefix-aware", "--router-options",
                       '{"seed": 0}')
    try:
        runs["prefix-aware"] = asyncio.run(run_workload(url))
        page = httpx.get(url + "/metrics", timeout=30).text
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert serve.status().applications == {}, "the stopped launch left its application behind"
    # read as a launch reads it, with Serve still up
    return runs, {"prefix-aware": page}, (running_serve_address(), serve_on_cluster[1])


def test_prefix_aware_routing_keeps_prefixes_on_one_replica_and_hits_the_cache_far_more(routing_runs):
    runs, _, _ = routing_runs
    aware, p2c = runs["prefix-aware"], runs["power-of-two"]
    print(f"prefix-aware: {aware['to_holder']:.0%} of repeat requests at their prefix's first replica, prefix-cache "
          f"hit rate {aware['hit_rate']:.0%}, TTFT p50 {aware['ttft_p50'] * 1e3:.0f} ms, "
          f"p99 {aware['ttft_p99'] * 1e3:.0f} ms; power-of-two: prefix-cache hit rate {p2c['hit_rate']:.0%}")
    assert len(aware["replicas"]) == 2 and len(p2c["replicas"]) == 2  # both replicas served
    assert aware["to_holder"] == 1.0
    assert aware["hit_rate"] > 0.6 and aware["hit_rate"] > p2c["hit_rate"] + 0.2


def test_the_fleet_metrics_page_has_every_replica_s_engine_metrics_and_the_router_s(routing_runs):
    from prometheus_client.parser import text_string_to_metric_families

    _, pages, _ = routing_runs
    families = {f.name: f for f in text_string_to_metric_families(pages["prefix-aware"])}
    waiting = families["pagoda:num_requests_waiting"].samples
    assert len({s.labels["replica"] for s in waiting}) == 2 and all(s.value == 0 for s in waiting)
    hits = sum(s.value for s in families["pagoda:prefix_cache_hits"].samples if s.name.endswith("_total"))
    routed: dict[str, float] = {}
    for s in families["pagoda:router_requests"].samples:
        routed[s.labels["reason"]] = routed.get(s.labels["reason"], 0) + s.value
    assert hits >= (NUM_ROUNDS - 1) * NUM_GROUPS * PREFIX_LEN * 0.9
    assert routed.get("prefix", 0) == (NUM_ROUNDS - 1) * NUM_GROUPS
    usage = families["pagoda:kv_cache_usage_perc"].samples
    assert all(s.value == 0 for s in usage)  # every finished request gave its blocks back


def test_a_launch_on_a_cluster_whose_serve_listens_elsewhere_is_told_which_address_to_pass(routing_runs):
    from pagoda.errors import ConfigError
    from pagoda.plugins.entrypoints.replicas.command import check_serve_address

    _, _, (running, port) = routing_runs
    assert running == ("127.0.0.1", port)  # the running Serve's proxy, as pagoda serve found it on the cluster
    check_serve_address(running, "127.0.0.1", port)
    check_serve_address(None, "0.0.0.0", port + 1)  # no Serve yet: this launch starts it where it is told
    for host, other in (("127.0.0.1", port + 1), ("0.0.0.0", port)):
        with pytest.raises(ConfigError) as refused:
            check_serve_address(running, host, other)
        assert str(refused.value) == (f"Ray Serve already runs on this cluster, its HTTP proxy on 127.0.0.1:{port}; "
                                      f"pass --host 127.0.0.1 --port {port} to serve the replicas there")


# --- pagoda serve --replicas 2 --replica-roles prefill,decode on the cluster's Serve

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
def fleet(serve_on_cluster, tmp_path_factory):
    """``pagoda serve --replicas 2 --replica-roles prefill,decode`` on the cluster's Serve, a tiny random Llama
    with the default model's chat template, the replicas sharing a ``shared-disk`` store."""
    from tiny_models import write_tiny_llama

    from pagoda.modeling.default_model import ensure_default_model

    root = tmp_path_factory.mktemp("replica-roles")
    model = write_tiny_llama(tmp_path_factory.mktemp("roles-tiny-llama"))
    shutil.copy(ensure_default_model() / "chat_template.jinja", model / "chat_template.jinja")
    store = root / "store"
    store.mkdir()
    proc, url = launch(root / "serve.log", model, serve_on_cluster, "--kv-cache-memory-bytes", str(16 << 20),
                       "--max-model-len", "512", "--replica-roles", "prefill,decode", "--kv-connector",
                       "shared-disk", "--kv-connector-options", json.dumps({"path": str(store)}))
    try:
        yield url, model, store
    finally:
        stop(proc)


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
