"""``pagoda serve --replicas 2`` as users run it: two engine replicas on Ray Serve behind one endpoint,
driven by the official ``openai`` client, with prefix-aware routing; against power-of-two routing over two
engines of the same model and pool, sent the same requests the same way."""

from __future__ import annotations

import asyncio
import os
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
# a tiny random Llama (tests/tiny_models.py): routing and prefix caching work on token ids, whatever the weights
MODEL = "tiny-llama"
BLOCK = 16
# 3 prompt prefixes of 8 blocks, interleaved; each replica's KV pool holds about 2 of them, so a
# replica that is sent all 3 in turn keeps evicting them
NUM_GROUPS, NUM_ROUNDS, PREFIX_LEN = 3, 5, 8 * BLOCK
POOL_FLAGS = ("--num-gpu-blocks-override", "24", "--max-model-len", "256")


def shared_prefix_prompts() -> list[tuple[int, list[int]]]:
    """(group, prompt token ids): each prompt is its group's prefix and one block of its own."""
    prompts = []
    for r in range(NUM_ROUNDS):
        for g in range(NUM_GROUPS):
            prefix = [1000 + 500 * g + i for i in range(PREFIX_LEN)]
            prompts.append((g, prefix + [5000 + 100 * r + 10 * g + i for i in range(BLOCK)]))
    return prompts


def replicas_env() -> dict[str, str]:
    """This process's environment when the command starts (ray.init here has put the cluster's token in it)."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def replicas_command(port: int, model: Path, *flags: str) -> list[str]:
    return [PAGODA, "serve", "--port", str(port), "--model", str(model), "--served-model-name", MODEL, "--dtype",
            "float32", "--replicas", "2", *POOL_FLAGS, *flags]


def start_replicas(log: Path, port: int, model: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as out:
        proc = subprocess.Popen(replicas_command(port, model, *flags), stdout=out, stderr=subprocess.STDOUT,
                                env=replicas_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        # Ray Serve says so once every replica has started (an engine replica answers /v1/models before the
        # other is up, and a workload sent then would all go to it)
        if "Application 'pagoda' is ready" in log.read_text():
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pagoda serve --replicas 2 did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


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
def routing_runs(tmp_path_factory):
    """The workload through ``pagoda serve --replicas 2`` with prefix-aware routing and the fleet metrics page
    after it; the same workload routed by power-of-two over two engines in this process; and the address of
    the running Serve as a launch reads it.

    The launch joins a local Ray cluster of 2 CPUs with ``--ray-address``, on which Ray Serve already runs (its
    controller and HTTP proxy started here, as an operator's cluster would have them): it adds its application
    to that Serve and deletes it when stopped, leaving Serve up."""
    import gc

    import ray
    from ray import serve

    from pagoda.plugins.entrypoints.replicas.command import controller_env, running_serve_address
    from tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    runs = {"power-of-two": power_of_two_control(model)}
    gc.collect()  # (its engines gone before the replicas start)
    address = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False).address_info["gcs_address"]
    pages = {}
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    controller_options={"runtime_env": {"env_vars": controller_env()}})
        log = tmp_path_factory.mktemp("replicas") / "prefix-aware.log"
        proc, url = start_replicas(log, port, model, "--router", "prefix-aware", "--router-options", '{"seed": 0}',
                                   "--ray-address", address)
        try:
            runs["prefix-aware"] = asyncio.run(run_workload(url))
            pages["prefix-aware"] = httpx.get(url + "/metrics", timeout=30).text
        finally:
            stop(proc)
        assert proc.returncode == 0, log.read_text()[-4000:]
        assert serve.status().applications == {}, "the stopped launch left its application behind"
        serve_address = (running_serve_address(), port)  # read as a launch reads it, with Serve still up
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs, pages, serve_address


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


def test_bad_replica_flags_fail_before_anything_starts(capsys):
    import ray

    from pagoda.cli import main

    assert not ray.is_initialized()
    cases = ((["--router", "nearest"], "unknown request router 'nearest'"),
             (["--replicas", "0"], "--replicas 0: pass 1 or more"),
             (["--replicas", "2", "--max-replicas", "1"], "autoscaling needs"),
             (["--router-options", '{"imbalance": 1}'], "does not take the options"))
    # the command's own entry point, in this process: the flags are read before Ray would start here
    try:
        for flags, message in cases:
            assert main(["serve", "--replicas", "2", *flags]) != 0
            stderr = capsys.readouterr().err
            assert message in stderr, stderr[-2000:]
            assert not ray.is_initialized(), flags
    finally:
        ray.shutdown()


def test_the_autoscaling_policy_asks_for_replicas_by_waiting_plus_running_requests():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from pagoda.plugins.entrypoints.replicas.autoscaling import queue_depth_policy

    dep = DeploymentID(name="pagoda-engine", app_name="pagoda")
    r1, r2 = ReplicaID("r1", dep), ReplicaID("r2", dep)

    def context(waiting: dict, running: dict) -> AutoscalingContext:
        return AutoscalingContext(
            deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=2,
            target_num_replicas=2, running_replicas=[r1, r2], total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics={"num_requests_waiting": waiting, "num_requests_running": running} if waiting
            or running else {}, raw_metrics=None, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
            current_time=time.time(), config=AutoscalingConfig(min_replicas=1, max_replicas=8,
                                                               target_ongoing_requests=16))

    assert queue_depth_policy(context({r1: 30.0, r2: 10.0}, {r1: 16.0, r2: 16.0}))[0] == 5  # 72 / 16
    assert queue_depth_policy(context({r1: 0.0, r2: 0.0}, {r1: 3.0, r2: 0.0}))[0] == 1
    assert queue_depth_policy(context({}, {}))[0] == 2  # nothing reported yet: stay


def test_each_replica_reads_the_tenant_where_pagoda_serve_was_told_to():
    from pagoda.cli import build_parser
    from pagoda.plugins.entrypoints.replicas.command import replica_options

    for source in ("api-key", "header", "user"):
        ns = build_parser().parse_args(["serve", "--replicas", "2", "--tenant-source", source,
                                        "--scheduling-policy", "fair", "--max-waiting-per-tenant", "4"])
        assert replica_options(ns, cpus=2).tenant_source == source
