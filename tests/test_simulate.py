"""pagoda simulate: traces, the cost model, the simulated engine and the report, without a model.

The scheduler and KV allocator are the real plugins; only the model is replaced by a cost model.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pagoda.cli import main
from pagoda import EngineArgs
from pagoda.errors import ConfigError
from pagoda.registry.plugin_manager import get_plugin_manager
from pagoda.plugins.entrypoints.simulate.calibrate import (PROBE_ROUNDS, PROBE_SHAPE, fit_block_moves,
                                                            measure_speed, probe_reference)
from pagoda.plugins.entrypoints.simulate.cost_model import FEATURES, CostModel, fit
from pagoda.plugins.entrypoints.simulate.report import format_run, summarize_run
from pagoda.plugins.entrypoints.simulate.request_log import RequestLogWriter, trace_from_request_log
from pagoda.plugins.entrypoints.simulate.simulator import build_engines, least_loaded, run_trace
from pagoda.plugins.entrypoints.simulate.trace import (PromptMaker, TraceRequest, flood_trace, generate_trace,
                                                       load_trace, save_trace)
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence, SequenceStatus

# 10 ms a step, 5 ms more if it decodes, 1 ms a prompt token, 2 ms a decoding sequence: numbers a reader can check
COST = CostModel({"step": 0.01, "decode_step": 0.005, "prefill_tokens": 0.001, "decode_seqs": 0.002, "decode_context": 0.0,
                  "prefill_attention": 0.0})


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def simulate(pm, trace, policy="fcfs", replicas=1, cost=COST, **engine_options):
    config = EngineArgs.build(scheduling_policy=policy, **engine_options).create_engine_config()
    engines, record = build_engines(config, pm, cost, trace, replicas)
    run_trace(trace, engines, least_loaded if replicas > 1 else None)  # the simulator's own simplest route
    return summarize_run(record, float("inf"), policy), engines


def test_a_generated_trace_survives_a_round_trip_through_its_file(tmp_path):
    trace = generate_trace(50, rate=10, num_groups=3, prefix_len=64, group_fraction=0.5, priority_levels=2, seed=1)
    assert save_trace(trace, tmp_path / "t.jsonl") == 50
    assert load_trace(tmp_path / "t.jsonl") == trace
    assert all(a.arrival <= b.arrival for a, b in zip(trace, trace[1:]))
    assert {r.priority for r in trace} == {0, 1}
    assert 0 < sum(r.prefix_group is not None for r in trace) < 50
    fixed = generate_trace(5, rate=1, prompt_len=7, output_len=3)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(7, 3)}


def test_a_bad_trace_line_is_named_with_its_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 8, "output_len": 4}\n{"arrival": 1, "prompt_len": 8, '
                    '"output_len": 0}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: output_len=0; expected an integer >= 1"):
        load_trace(path)
    path.write_text('{"arrival": 0, "output_len": 4}\n')
    with pytest.raises(ConfigError, match="prompt_token_ids or as prompt_len"):
        load_trace(path)


def test_synthetic_prompts_share_exactly_their_group_prefix():
    maker = PromptMaker(vocab_size=49152)
    a = maker.tokens(0, TraceRequest(0, 4, 100, prefix_group=7, prefix_len=60))
    b = maker.tokens(1, TraceRequest(0, 4, 90, prefix_group=7, prefix_len=60))
    c = maker.tokens(2, TraceRequest(0, 4, 100, prefix_group=8, prefix_len=60))
    assert (len(a), len(b)) == (100, 90)
    assert a[:60] == b[:60] and a[60] != b[60]
    assert a[0] != c[0] or a[:60] != c[:60]
    assert min(a + b + c) >= 100


def test_the_request_log_records_finished_requests_and_converts_to_a_trace(tmp_path):
    log = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(log)
    for i, (arrival, num_out) in enumerate(((100.0, 3), (100.5, 0), (101.25, 2))):
        seq = Sequence(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=3), arrival_time=arrival, priority=i,
                       parent_id=f"r{i}", tenant="alice" if i else None)
        for _ in range(num_out):
            seq.append_output_tokens([11], 1 << 20)
        seq.first_token_time = arrival + 0.2 if num_out else None
        seq.status = SequenceStatus.FINISHED_LENGTH if num_out else SequenceStatus.FINISHED_ABORTED
        writer.pagoda_request_finished(seq)
    writer.close()
    first = json.loads(log.read_text().splitlines()[0])
    assert first["prompt_token_ids"] == [5, 6, 7] and first["num_output_tokens"] == 3 and first["ttft"] == 0.2
    trace, skipped = trace_from_request_log(log)
    assert skipped == 1  # aborted before its first token
    assert [(r.arrival, r.output_len, r.priority, r.prompt_token_ids, r.tenant) for r in trace] == [
        (0.0, 3, 0, [5, 6, 7], None), (1.25, 2, 2, [5, 6, 9], "alice")]


def test_a_request_log_replays_its_tenants_under_fair(pm, tmp_path):
    """A log of a flooding tenant beside a small one: the replay keeps the tenants, so under ``fair`` the small
    tenant's tokens come faster than under ``fcfs``, and the report names both tenants."""
    log = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(log)
    lines = [(f"f{i}", "flood", 0.0, 64) for i in range(12)] + [(f"s{i}", "small", 0.01 * (i + 1), 4) for i in range(3)]
    for rid, tenant, arrival, num_out in lines:
        seq = Sequence(rid, [5, 6, 7, 8], SamplingParams(max_tokens=num_out), arrival_time=arrival, parent_id=rid,
                       tenant=tenant)
        for _ in range(num_out):
            seq.append_output_tokens([11], 1 << 20)
        seq.first_token_time = arrival + 0.1
        seq.status = SequenceStatus.FINISHED_LENGTH
        writer.pagoda_request_finished(seq)
    writer.close()
    trace, _ = trace_from_request_log(log)
    assert Counter(r.tenant for r in trace) == {"flood": 12, "small": 3}
    fcfs, _ = simulate(pm, trace, "fcfs")
    fair, _ = simulate(pm, trace, "fair")
    assert set(fair["by_tenant"]) == {"flood", "small"}
    # fcfs runs the small requests in steps of all fifteen sequences, fair in bounded steps beside one of the flood
    assert fair["by_tenant"]["small"]["tpot_ms"]["mean"] < fcfs["by_tenant"]["small"]["tpot_ms"]["mean"]
    with pytest.raises(ConfigError, match="tenant=5"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({**json.loads(log.read_text().splitlines()[0]), "tenant": 5}) + "\n")
        trace_from_request_log(bad)


def test_the_fit_recovers_the_coefficients_that_made_the_step_times():
    true = {"step": 0.02, "decode_step": 0.02, "prefill_tokens": 0.0015, "decode_seqs": 0.003, "decode_context": 2e-6,
            "prefill_attention": 1e-8}
    model = CostModel(true)
    samples = [((int(d > 0), p, d, d * c, p * p / 2), 0.0) for p in (0, 16, 256, 1024) for d in (0, 1, 8, 64) for c in (64, 512)
               if p or d]
    samples = [(f, model.predict(f)) for f, _ in samples]
    fitted = fit(samples)
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(true[name], rel=1e-3, abs=1e-12)
    assert fitted.meta["median_rel_error"] < 1e-6


def test_a_missing_cost_model_says_how_to_calibrate(tmp_path):
    with pytest.raises(ConfigError, match="pagoda simulate --calibrate"):
        CostModel.load(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="lacks coefficients"):
        CostModel({"step": 0.1})


def test_one_request_alone_takes_its_prefill_and_decode_steps(pm):
    trace = [TraceRequest(0.0, output_len=3, prompt_len=100)]
    summary, _ = simulate(pm, trace)
    # prefill step: 10 + 100 ms gives the first token; two decode steps of 10 + 5 + 2 ms each give the rest
    assert summary["ttft_ms"]["p50"] == pytest.approx(110)
    assert summary["e2e_ms"]["p50"] == pytest.approx(144)
    assert summary["itl_ms"]["p50"] == pytest.approx(17)
    assert summary["completed"] == 1 and summary["output_tokens"] == 3


def test_priority_beats_fcfs_on_high_priority_ttft_when_overloaded(pm):
    # a burst of 60 requests, every third one urgent (priority 0), arriving faster than the engine serves
    trace = [TraceRequest(i * 0.01, output_len=20, prompt_len=200, priority=0 if i % 3 == 0 else 1)
             for i in range(60)]
    fcfs, _ = simulate(pm, trace, "fcfs", max_num_seqs=4)
    prio, _ = simulate(pm, trace, "priority", max_num_seqs=4)
    urgent_fcfs, urgent_prio = fcfs["ttft_ms_by_priority"][0], prio["ttft_ms_by_priority"][0]
    assert urgent_prio["mean"] < 0.6 * urgent_fcfs["mean"]
    assert urgent_prio["p99"] < urgent_fcfs["p99"]
    # the others pay for it
    assert prio["ttft_ms_by_priority"][1]["mean"] > fcfs["ttft_ms_by_priority"][1]["mean"]
    assert fcfs["completed"] == prio["completed"] == 60


def test_a_small_pool_preempts_and_swaps_and_the_report_counts_it(pm):
    trace = [TraceRequest(0.0, output_len=120, prompt_len=60) for _ in range(12)]
    summary, _ = simulate(pm, trace, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.05)
    assert summary["completed"] == 12
    assert summary["preemptions"] > 0 and summary["swapped_out_requests"] > 0 and summary["blocks_swapped"] > 0
    assert summary["kv_usage"]["max"] > 0.9
    assert len(summary["kv_usage"]["series"]) == 20


def test_shared_prefixes_show_in_the_prefix_cache_hit_rate(pm):
    shared = [TraceRequest(i * 0.5, 4, 272, prefix_group=1, prefix_len=256) for i in range(10)]
    alone = [TraceRequest(i * 0.5, 4, 272) for i in range(10)]
    hit_shared = simulate(pm, shared)[0]["prefix_cache_hit_rate"]
    assert hit_shared == pytest.approx(9 * 256 / (10 * 272))
    assert simulate(pm, alone)[0]["prefix_cache_hit_rate"] == 0.0


def test_two_replicas_share_the_load_and_finish_everything(pm):
    trace = generate_trace(80, rate=50, seed=3)
    one, _ = simulate(pm, trace, max_num_seqs=8)
    two, engines = simulate(pm, trace, replicas=2, max_num_seqs=8)
    assert two["completed"] == one["completed"] == 80
    assert all(e.num_steps > 0 for e in engines)
    assert two["ttft_ms"]["mean"] < one["ttft_ms"]["mean"]


def test_the_prefix_aware_router_keeps_each_group_on_one_replica_and_hits_more(pm):
    from pagoda.execution.routing import make_router
    from pagoda.plugins.entrypoints.simulate.simulator import router_route

    # 4 prefix groups arriving in turn, 2 replicas whose pools hold about two groups' prefixes each
    trace = [TraceRequest(i * 0.05, 8, 272, prefix_group=i % 4, prefix_len=256) for i in range(64)]
    config = EngineArgs.build(num_gpu_blocks_override=48, max_num_seqs=4).create_engine_config()
    hit_rates = {}
    for name in ("least-loaded", "prefix-aware"):
        engines, record = build_engines(config, pm, COST, trace, 2)
        # seeded: least-loaded breaks ties at random, and a lucky draw can keep the groups apart too
        run_trace(trace, engines, router_route(make_router(name, {"seed": 0}, pm), config.cache.block_size))
        summary = summarize_run(record, 20.0, name)
        assert summary["completed"] == 64 and all(e.num_steps for e in engines)
        hit_rates[name] = summary["prefix_cache_hit_rate"]
    assert hit_rates["prefix-aware"] > hit_rates["least-loaded"] + 0.2


def test_pagoda_simulate_prints_json_for_a_generated_trace(tmp_path, capsys):
    COST.save(tmp_path / "cost.json")
    rc = main(["simulate", "--generate", "--num-requests", "40", "--rate", "20", "--priority-levels", "2",
               "--cost-model", str(tmp_path / "cost.json"), "--compare-policy", "priority", "--json", "--no-rescale",
               "--max-num-seqs", "8", "--replicas", "2", "--router", "prefix-aware", "--router-options",
               '{"imbalance_threshold": 4}'])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in result["runs"]] == [f"pagoda simulate: {p} x2 replicas, prefix-aware router"
                                                     for p in ("fcfs", "priority")]
    run = result["runs"][0]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms", "request_throughput", "preemptions",
                "prefix_cache_hit_rate", "kv_usage"):
        assert key in run
    assert run["completed"] == 40


def test_pagoda_simulate_refuses_two_trace_sources_and_a_missing_cost_model(tmp_path, capsys):
    assert main(["simulate", "--generate", "--workload", "W1"]) == 2
    assert "exactly one trace source" in capsys.readouterr().err
    assert main(["simulate", "--generate", "--cost-model", str(tmp_path / "none.json")]) == 2  # before any engine
    assert "--calibrate" in capsys.readouterr().err


def test_a_cost_model_saved_before_block_moves_were_calibrated_still_loads_and_moves_cost_nothing(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": 1, "coefficients": COST.coefficients, "meta": {"threads": 1}}))
    old = CostModel.load(path)
    assert not old.has_move_costs and old.move_seconds(50) == 0.0
    assert old.step_seconds([1, 1], [10, 20], num_blocks_moved=50) == old.step_seconds([1, 1], [10, 20])
    new = CostModel(dict(COST.coefficients, block_move_step=0.002, block_move=0.0001))
    assert new.has_move_costs
    assert new.step_seconds([100], [0], num_blocks_moved=50) == pytest.approx(0.11 + 0.002 + 0.005)
    # what a v1 file lacks shows after a round trip through a v2 file
    assert CostModel.load(new.save(tmp_path / "v2.json")).coefficients == new.coefficients


def test_swapping_adds_the_block_move_time_to_the_simulated_steps(pm):
    trace = [TraceRequest(0.0, output_len=120, prompt_len=60) for _ in range(12)]
    options = dict(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.05)
    free, _ = simulate(pm, trace, **options)
    priced, _ = simulate(pm, trace, cost=CostModel(dict(COST.coefficients, block_move_step=0.0, block_move=0.001)),
                         **options)
    # all requests arrive at once, so the schedule is the same: the run is longer by 1 ms per block moved
    assert priced["blocks_swapped"] == free["blocks_swapped"] > 0
    assert priced["duration_s"] - free["duration_s"] == pytest.approx(0.001 * free["blocks_swapped"], rel=1e-6)


def test_a_scaled_cost_model_stretches_every_step_by_the_factor(pm):
    trace = [TraceRequest(0.0, output_len=3, prompt_len=100)]
    summary, _ = simulate(pm, trace, cost=COST.scaled(2.0, "twice as slow"))
    assert summary["ttft_ms"]["p50"] == pytest.approx(220)
    assert summary["e2e_ms"]["p50"] == pytest.approx(288)
    with pytest.raises(ConfigError, match="not a positive number"):
        COST.scaled(0.0)


def test_the_block_move_fit_recovers_a_fixed_and_a_per_block_cost():
    samples = [(n, 0.0003 + 0.00002 * n) for n in (1, 4, 16, 64) for _ in range(3)] + [(16, 1.0)]  # one outlier
    fixed, per_block = fit_block_moves(samples)
    assert fixed == pytest.approx(0.0003, rel=1e-6) and per_block == pytest.approx(0.00002, rel=1e-6)


def test_the_probe_reference_is_used_only_when_it_was_taken_with_the_probe_of_today():
    probe = {"shape": list(PROBE_SHAPE), "rounds": PROBE_ROUNDS, "seconds": [1.2, 1.3, 1.5], "reference_seconds": 1.3}
    assert probe_reference(CostModel(COST.coefficients, {"probe": probe})) == 1.3
    assert probe_reference(COST) is None  # saved before calibration recorded a probe
    other_shape = dict(probe, shape=[8, 48, 16])
    assert probe_reference(CostModel(COST.coefficients, {"probe": other_shape})) is None
    assert probe_reference(CostModel(COST.coefficients, {"probe": dict(probe, rounds=PROBE_ROUNDS + 1)})) is None
    assert probe_reference(CostModel(COST.coefficients, {"probe": dict(probe, reference_seconds=0)})) is None


def test_a_cost_model_from_another_cpu_is_not_rescaled_to_this_one(tmp_path, capsys):
    elsewhere = CostModel(COST.coefficients, {"cpu": "Some Other CPU"})
    speed = measure_speed(None, elsewhere)  # refused before any engine is needed
    assert speed["scale"] is None and "Some Other CPU" in speed["note"]
    elsewhere.save(tmp_path / "cost.json")
    assert main(["simulate", "--generate", "--num-requests", "10", "--cost-model", str(tmp_path / "cost.json"),
                 "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "calibrated on Some Other CPU" in captured.err and result["cost_model_scale"] == 1.0
    assert result["runs"][0]["completed"] == 10


def test_the_fair_policy_keeps_a_small_tenant_within_2x_of_its_unloaded_times_beside_a_flood(pm):
    trace = flood_trace(num_small=5, small_rate=10.0, small_output_len=8, flood_requests=4, flood_n=4,
                        flood_output_len=200)
    alone = [r for r in trace if r.tenant == "small"]
    unloaded, _ = simulate(pm, alone, "fair", fair_step_seqs=4)
    fcfs, _ = simulate(pm, trace, "fcfs")
    fair, _ = simulate(pm, trace, "fair", fair_step_seqs=4)
    assert "by_tenant" not in unloaded and set(fair["by_tenant"]) == {"flood", "small"}
    base = unloaded["tpot_ms"]["mean"]
    small_fcfs, small_fair = fcfs["by_tenant"]["small"], fair["by_tenant"]["small"]
    # fcfs: every step runs the 16 flooding sequences; fair: four sequences a step while the small tenant is active
    assert small_fcfs["tpot_ms"]["mean"] > 2 * base
    assert small_fair["tpot_ms"]["mean"] < 2 * base
    # the first small request waits for the rest of a step of all sixteen (the flood was alone); the others
    # arrive while the steps are bounded
    assert small_fair["ttft_ms"]["p50"] < 2 * unloaded["ttft_ms"]["p50"] < small_fcfs["ttft_ms"]["p50"]
    assert fcfs["completed"] == fair["completed"] == len(trace)
    # the flood pays: its requests take longer under fair
    assert fair["by_tenant"]["flood"]["tpot_ms"]["mean"] > fcfs["by_tenant"]["flood"]["tpot_ms"]["mean"]


def test_a_trace_line_keeps_its_tenant_and_a_bad_tenant_is_named(tmp_path):
    trace = flood_trace(num_small=2, flood_requests=1, flood_n=2, flood_output_len=4)
    save_trace(trace, tmp_path / "t.jsonl")
    assert [r.tenant for r in load_trace(tmp_path / "t.jsonl")] == ["flood", "flood", "small", "small"]
    (tmp_path / "bad.jsonl").write_text('{"arrival": 0, "prompt_len": 4, "output_len": 2, "tenant": 7}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: tenant=7"):
        load_trace(tmp_path / "bad.jsonl")


def test_pagoda_simulate_reports_each_tenant_of_the_flood_workload(tmp_path, capsys):
    COST.save(tmp_path / "cost.json")
    rc = main(["simulate", "--workload", "FLOOD", "--num-requests", "3", "--rate", "4", "--output-len", "40",
               "--cost-model", str(tmp_path / "cost.json"), "--no-rescale", "--scheduling-policy", "fair",
               "--compare-policy", "fcfs"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "pagoda simulate: fair" in out and "pagoda simulate: fcfs" in out
    assert out.count("TTFT small") == 2 and out.count("TPOT flood") == 2


def test_pipeline_stages_add_their_hand_offs_to_each_step_and_hold_more_kv_blocks(pm):
    from pagoda.plugins.entrypoints.simulate.cost_model import PipelineHandoff
    from pagoda.plugins.entrypoints.simulate.simulator import kv_cache_blocks

    staged = EngineArgs.build(pipeline_parallel_size=2).create_engine_config()
    whole = EngineArgs.build().create_engine_config()
    # each stage keeps the K/V of 15 of the 30 layers in the same memory
    assert abs(kv_cache_blocks(staged)[0] - 2 * kv_cache_blocks(whole)[0]) <= 1
    trace = [TraceRequest(0.0, output_len=3, prompt_len=100)]
    # 1 ms a hand-off plus 4 kB a token at 1 GB/s
    engines, record = build_engines(staged, pm, COST, trace, handoff=PipelineHandoff(2, 0.001, 1e9, 4000))
    run_trace(trace, engines)
    summary = summarize_run(record, float("inf"), "2 stages")
    assert summary["ttft_ms"]["p50"] == pytest.approx(110 + 1 + 0.4)
    assert summary["itl_ms"]["p50"] == pytest.approx(17 + 1 + 0.004)
    handoffs, steps = 1.4 + 2 * 1.004, 111.4 + 2 * 18.004  # ms
    assert summary["pipeline_handoff_share"] == pytest.approx(handoffs / steps)


# ---- LoRA adapters ------------------------------------------------------------------------------


def lora_trace(num_adapters: int, num_requests: int = 16, gap: float = 0.0) -> list[TraceRequest]:
    """Requests cycling through ``num_adapters`` adapters; every fifth request is the base model's."""
    return [TraceRequest(i * gap, 4, 40, lora_name=None if i % 5 == 4 else f"lora-{i % num_adapters}")
            for i in range(num_requests)]


def test_a_trace_line_keeps_its_adapter_and_a_bad_adapter_name_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    save_trace(lora_trace(2, 4), path)
    assert [r.lora_name for r in load_trace(path)] == ["lora-0", "lora-1", "lora-0", "lora-1"]
    path.write_text('{"arrival": 0, "prompt_len": 4, "output_len": 2, "lora_name": 7}\n')
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: lora_name=7; expected the LoRA adapter's name"):
        load_trace(path)


def test_the_request_log_carries_each_requests_adapter_into_the_trace(tmp_path):
    from pagoda import LoRARequest

    log = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(log)
    for i, lora in enumerate((LoRARequest("sql", 1, "/adapters/sql"), None)):
        seq = Sequence(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=1), arrival_time=10.0 + i, parent_id=f"r{i}",
                       lora_request=lora)
        seq.append_output_tokens([11], 1 << 20)
        seq.first_token_time = 10.1 + i
        seq.status = SequenceStatus.FINISHED_LENGTH
        writer.pagoda_request_finished(seq)
    writer.close()
    trace, _ = trace_from_request_log(log)
    assert [r.lora_name for r in trace] == ["sql", None]


def test_a_trace_with_adapters_needs_lora_on(pm):
    with pytest.raises(ConfigError, match="the trace names LoRA adapters; pass --enable-lora"):
        simulate(pm, lora_trace(2))


def test_adapter_loads_cost_step_time_and_max_loras_holds_requests_back(pm):
    from pagoda.plugins.entrypoints.simulate.lora import LoRACosts

    costs = LoRACosts(load_seconds=0.5, slot_seconds=0.1)

    def run(trace, **options):
        config = EngineArgs.build(enable_lora=True, **options).create_engine_config()
        engines, record = build_engines(config, pm, COST, trace, 1, lora_costs=costs)
        run_trace(trace, engines)
        return summarize_run(record, float("inf"), "lora")

    at_once = lora_trace(4)  # 13 adapter requests of 4 adapters and 3 base-model requests
    roomy = run(at_once, max_loras=4, max_cpu_loras=4)
    assert roomy["completed"] == 16
    assert (roomy["lora"]["adapters"], roomy["lora"]["loads_from_disk"], roomy["lora"]["slot_loads"]) == (4, 4, 4)
    assert roomy["lora"]["load_seconds"] == pytest.approx(4 * 0.6)
    # two slots for four adapters: the scheduler holds the other two adapters' requests back until the first two
    # adapters' requests finish
    tight = run(at_once, max_loras=2, max_cpu_loras=2)
    assert tight["completed"] == 16 and tight["lora"]["slot_loads"] == 4
    assert tight["lora"]["ttft_ms_adapters"]["p90"] > roomy["lora"]["ttft_ms_adapters"]["p90"]
    assert "LoRA adapters" in format_run(tight)
    # one request at a time cycling through four adapters: with two slots (and two in memory) every adapter request
    # loads its adapter from disk again; with four, each adapter is loaded once
    spaced = lora_trace(4, gap=1.0)
    cycled = run(spaced, max_loras=2, max_cpu_loras=2)["lora"]
    assert cycled["slot_loads"] == cycled["loads_from_disk"] == 13
    kept = run(spaced, max_loras=2, max_cpu_loras=4)["lora"]
    assert (kept["slot_loads"], kept["loads_from_disk"]) == (13, 4)


def test_the_prefix_aware_router_keeps_each_adapter_on_one_replica_in_the_simulator(pm):
    from pagoda.execution.routing import make_router
    from pagoda.plugins.entrypoints.simulate.lora import LoRACosts
    from pagoda.plugins.entrypoints.simulate.simulator import router_route

    trace = lora_trace(4, num_requests=64, gap=0.05)
    config = EngineArgs.build(enable_lora=True, max_loras=2, max_cpu_loras=2, max_num_seqs=4).create_engine_config()
    slot_loads = {}
    for name in ("least-loaded", "prefix-aware"):
        engines, record = build_engines(config, pm, COST, trace, 2, lora_costs=LoRACosts(0.05, 0.01))
        run_trace(trace, engines, router_route(make_router(name, {"seed": 0}, pm), config.cache.block_size))
        summary = summarize_run(record, 20.0, name)
        assert summary["completed"] == 64
        slot_loads[name] = summary["lora"]["slot_loads"]
    assert slot_loads["prefix-aware"] <= 4 < slot_loads["least-loaded"]
