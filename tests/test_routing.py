"""Request routers (pagoda.execution.routing): the decisions behind ``pagoda serve --replicas``, without Ray."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagoda.errors import ConfigError
from pagoda.interfaces import Router
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.plugins.entrypoints.replicas.fleet_metrics import merge_replica_metrics
from pagoda.registry.plugin_manager import get_plugin_manager
from pagoda.execution.routing import (LeastLoadedRouter, PowerOfTwoRouter, PrefixAwareRouter, ReplicaLoad, RoutingRequest,
                            make_router, prompt_block_hashes)
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence

BLOCK = 16


def request(tokens: list[int], rid: str = "r") -> RoutingRequest:
    return RoutingRequest(rid, tuple(prompt_block_hashes(tokens, BLOCK)), len(tokens))


def idle(*names: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(n, 0) for n in names]


def prefix(group: int, length: int = 64) -> list[int]:
    return [1000 * (group + 1) + i for i in range(length)]


def route_and_record(router, req: RoutingRequest, replicas: list[ReplicaLoad]):
    decision = router.route(req, replicas)
    router.on_routed(req, decision.replica_id)
    return decision


def test_prompt_block_hashes_are_the_prefix_cache_s_keys_of_the_full_blocks():
    tokens = list(range(100, 150))  # 3 full blocks and 2 tokens
    kv = PagedKVCacheManager(num_blocks=8, block_size=BLOCK)
    seq = Sequence("s", tokens, SamplingParams(max_tokens=1), eos_token_id=None)
    kv.allocate_slots(seq, len(tokens))
    kv.free(seq)
    hashes = prompt_block_hashes(tokens, BLOCK)
    assert len(hashes) == 3 and hashes == prompt_block_hashes(tokens[:48], BLOCK)
    assert prompt_block_hashes(tokens[:15], BLOCK) == []
    # a second sequence with the same prompt finds exactly those blocks in the prefix cache
    again = Sequence("t", tokens, SamplingParams(max_tokens=1), eos_token_id=None)
    assert kv.get_computed_blocks(again)[1] == 48


def test_requests_sharing_a_prefix_go_to_the_replica_that_was_sent_it():
    router = PrefixAwareRouter(seed=0)
    replicas = idle("a", "b")
    first = {g: route_and_record(router, request(prefix(g) + [g, 7]), replicas).replica_id for g in range(4)}
    assert Counter(first.values()) == {"a": 2, "b": 2}  # new prefixes spread over the idle replicas
    for round_ in range(3):
        for g in range(4):
            decision = route_and_record(router, request(prefix(g) + [round_, g, 9]), replicas)
            assert decision.replica_id == first[g] and decision.reason == "prefix"
            assert decision.num_matched_blocks == 4


def test_the_longest_recorded_prefix_wins_and_short_matches_can_be_ignored():
    router = PrefixAwareRouter(min_match_blocks=3, seed=0)
    shared = prefix(0, 32)
    router.on_routed(request(shared + prefix(1, 32)), "a")  # 4 blocks on a, 2 of them shared
    router.on_routed(request(shared + prefix(2, 32)), "b")
    assert route_and_record(router, request(shared + prefix(1, 48)), idle("a", "b")).replica_id == "a"
    # only the 2 shared blocks match anywhere: below min_match_blocks, so the least loaded replica
    decision = router.route(request(shared + prefix(3, 32)), [ReplicaLoad("a", 3), ReplicaLoad("b", 1)])
    assert (decision.replica_id, decision.reason) == ("b", "least_loaded")


def test_an_imbalanced_load_overrides_the_prefix_and_ties_go_to_the_less_loaded_holder():
    router = PrefixAwareRouter(imbalance_threshold=4, seed=0)
    req = request(prefix(0))
    router.on_routed(req, "a")
    router.on_routed(req, "b")
    assert router.route(req, [ReplicaLoad("a", 2), ReplicaLoad("b", 1)]).replica_id == "b"
    assert router.route(req, [ReplicaLoad("a", 2), ReplicaLoad("b", 1), ReplicaLoad("c", 0)]).reason == "prefix"
    decision = router.route(req, [ReplicaLoad("a", 9), ReplicaLoad("b", 9), ReplicaLoad("c", 0)])
    assert (decision.replica_id, decision.reason) == ("c", "imbalance")


def test_a_bounded_record_forgets_the_oldest_prompts_tails_first():
    router = PrefixAwareRouter(max_hashes_per_replica=6, seed=0)
    old, new = request(prefix(0)), request(prefix(1))  # 4 blocks each
    router.on_routed(old, "a")
    router.on_routed(new, "a")
    assert router.num_matched_blocks(new, "a") == 4
    assert router.num_matched_blocks(old, "a") == 2  # its first 2 blocks are still a prefix
    router.on_replica_removed("a")
    assert router.num_matched_blocks(new, "a") == 0


def test_power_of_two_takes_the_less_loaded_of_two_random_replicas():
    router = PowerOfTwoRouter(seed=1)
    replicas = [ReplicaLoad(name, load) for name, load in zip("abcd", (5, 0, 3, 9))]
    chosen = Counter(router.route(request(prefix(0)), replicas).replica_id for _ in range(600))
    assert "d" not in chosen  # never the more loaded of its pair
    assert chosen["b"] == pytest.approx(300, abs=60)  # b wins every pair it is drawn in: half of them


def test_least_loaded_spreads_ties_over_the_replicas_used_least():
    router = LeastLoadedRouter(seed=0)
    picks = [route_and_record(router, request([]), idle("a", "b", "c")).replica_id for _ in range(6)]
    assert Counter(picks) == {"a": 2, "b": 2, "c": 2}


def test_routers_are_components_selected_by_name_with_options():
    pm = get_plugin_manager()
    assert {"prefix-aware", "power-of-two", "least-loaded"} <= set(pm.names("pagoda_routers"))
    router = make_router("prefix-aware", {"imbalance_threshold": 2}, pm)
    assert isinstance(router, Router) and router.imbalance_threshold == 2
    with pytest.raises(ConfigError, match="unknown request router 'nearest'.*prefix-aware"):
        make_router("nearest", None, pm)
    with pytest.raises(ValueError, match="does not take the options \\['imbalance'\\]"):
        make_router("prefix-aware", {"imbalance": 2}, pm)
    with pytest.raises(ValueError, match="imbalance_threshold must be >= 0"):
        make_router("prefix-aware", {"imbalance_threshold": -1}, pm)
    with pytest.raises(ValueError, match="replica list is empty"):
        router.route(request([]), [])


def test_prefix_aware_routing_keeps_each_prefix_on_one_replica_where_random_routing_scatters_it():
    rng = random.Random(0)
    groups = [rng.randrange(8) for _ in range(400)]
    spread = {}
    for router in (PrefixAwareRouter(seed=0), PowerOfTwoRouter(seed=0)):
        homes: dict[int, set] = {}
        for i, g in enumerate(groups):
            homes.setdefault(g, set()).add(route_and_record(router, request(prefix(g) + [i]), idle(*"abcd")).replica_id)
        spread[type(router).__name__] = max(len(h) for h in homes.values())
    assert spread == {"PrefixAwareRouter": 1, "PowerOfTwoRouter": 4}


def test_replica_metrics_merge_into_one_page_with_a_replica_label():
    page = ('# HELP pagoda:num_requests_waiting Waiting.\n# TYPE pagoda:num_requests_waiting gauge\n'
            'pagoda:num_requests_waiting{model_name="m"} {n}\n# HELP up Up.\n# TYPE up gauge\nup 1.0\n')
    merged = merge_replica_metrics({"r1": page.replace("{n}", "2.0"), "r2": page.replace("{n}", "0.0")})
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(merged)}
    waiting = {s.labels["replica"]: s.value for s in families["pagoda:num_requests_waiting"].samples}
    assert waiting == {"r1": 2.0, "r2": 0.0}
    assert [s.labels for s in families["up"].samples] == [{"replica": "r1"}, {"replica": "r2"}]
    assert merged.count("# TYPE pagoda:num_requests_waiting") == 1


# ---- LoRA adapters ------------------------------------------------------------------------------


def lora_request(tokens: list[int], lora_name, rid: str = "r") -> RoutingRequest:
    return RoutingRequest(rid, tuple(prompt_block_hashes(tokens, BLOCK, lora_name)), len(tokens), lora_name)


def test_an_adapters_prompt_hashes_apart_from_the_base_models_and_other_adapters():
    tokens = prefix(0)
    base, a, b = (prompt_block_hashes(tokens, BLOCK, name) for name in (None, "a", "b"))
    assert len(base) == len(a) == len(b) == 4
    assert not set(base) & set(a) and not set(a) & set(b)
    assert a == prompt_block_hashes(tokens, BLOCK, "a")


def test_the_prefix_aware_router_sends_an_adapters_requests_to_a_replica_that_has_it():
    router = PrefixAwareRouter(seed=0)
    first = route_and_record(router, lora_request(prefix(1), "sql"), idle("r1", "r2"))
    other = "r2" if first.replica_id == "r1" else "r1"
    # a new prompt for the same adapter: its replica is busier but has the adapter
    loads = [ReplicaLoad(first.replica_id, 3), ReplicaLoad(other, 0)]
    again = route_and_record(router, lora_request(prefix(2), "sql"), loads)
    assert (again.replica_id, again.reason, again.num_matched_blocks) == (first.replica_id, "lora", 0)
    # another adapter, on no replica yet: the least loaded; the base model: the least loaded too
    chat = route_and_record(router, lora_request(prefix(3), "chat"), loads)
    assert (chat.replica_id, chat.reason) == (other, "least_loaded")
    assert router.route(request(prefix(4)), loads).replica_id == other
    # a prompt routed before with the adapter: prefix among the replicas holding it
    repeat = router.route(lora_request(prefix(2), "sql"), loads)
    assert (repeat.replica_id, repeat.reason, repeat.num_matched_blocks) == (first.replica_id, "prefix", 4)


def test_imbalanced_loads_override_the_adapter_preference():
    router = PrefixAwareRouter(imbalance_threshold=4, seed=0)
    first = route_and_record(router, lora_request(prefix(1), "sql"), idle("r1", "r2"))
    other = "r2" if first.replica_id == "r1" else "r1"
    decision = router.route(lora_request(prefix(2), "sql"), [ReplicaLoad(first.replica_id, 9), ReplicaLoad(other, 0)])
    assert (decision.replica_id, decision.reason) == (other, "imbalance")


def test_a_replica_remembers_only_its_last_max_loras_per_replica_adapters():
    router = PrefixAwareRouter(max_loras_per_replica=2, seed=0)
    for name in ("a", "b", "c"):
        route_and_record(router, lora_request(prefix(1), name), idle("only"))
    assert not router.has_lora("only", "a") and router.has_lora("only", "b") and router.has_lora("only", "c")
    router.on_replica_removed("only")
    assert not router.has_lora("only", "c")
    with pytest.raises(ValueError, match="max_loras_per_replica >= 1"):
        PrefixAwareRouter(max_loras_per_replica=0)


def test_the_ingress_reads_the_adapter_from_the_requests_model():
    from pagoda.plugins.entrypoints.replicas.deployments import requested_lora

    base = {"HuggingFaceTB/SmolLM2-135M-Instruct", "/models/smollm2"}
    assert requested_lora({"model": "sql", "prompt": "x"}, base) == "sql"
    assert requested_lora({"model": "/models/smollm2"}, base) is None
    assert requested_lora({"prompt": "x"}, base) is None
    assert requested_lora({"model": "sql"}, None) is None  # LoRA off: every model name is the base model's
