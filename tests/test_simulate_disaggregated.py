"""pagoda simulate --prefill-decode P:D: prefill and decode instances sharing a KV store, against engines that do
both, with goodput under TTFT/TPOT targets. The real scheduler and KV allocator plugins, a cost model for the
model; timings a reader can check by hand."""

from __future__ import annotations

import json
import math
import random

import pytest

from pagoda import EngineArgs
from pagoda.cli import main
from pagoda.plugins.entrypoints.simulate.command import simulate_disaggregated, simulate_once
from pagoda.plugins.entrypoints.simulate.cost_model import CostModel
from pagoda.plugins.entrypoints.simulate.disaggregated import KVHandoff
from pagoda.plugins.entrypoints.simulate.trace import TraceRequest, save_trace
from pagoda.registry.plugin_manager import get_plugin_manager

# 10 ms a step, 5 ms more if it decodes, 1 ms a prompt token, 2 ms a decoding sequence
COST = CostModel({"step": 0.01, "decode_step": 0.005, "prefill_tokens": 0.001, "decode_seqs": 0.002,
                  "decode_context": 0.0, "prefill_attention": 0.0})


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


@pytest.fixture(scope="module")
def config():
    return EngineArgs.build().create_engine_config()


def mixed_trace(n: int = 200, rate: float = 2.0, seed: int = 0) -> list[TraceRequest]:
    """Short chats (100-token prompts, 64 tokens out) with one long prompt (2,000 tokens, 16 out) in ten."""
    rng = random.Random(seed)
    trace, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.1
        trace.append(TraceRequest(t, 16 if long else 64, 2000 if long else 100))
    return trace


def test_one_request_s_ttft_is_its_prefill_the_handoff_and_the_decode_instance_s_first_step(pm, config):
    handoff = KVHandoff(fixed_s=0.002, per_block_s=0.0005)
    summary, _ = simulate_disaggregated(config, pm, COST, [TraceRequest(0.0, 4, 40)], 1, 1, 0, math.inf,
                                        "least-loaded", None, handoff, slo=(1.0, 0.1))
    # the prefill instance computes all 40 tokens; the decode instance loads the 2 full blocks and computes the
    # last 8 tokens (its first token), then decodes one token a step
    prefill = COST.step_seconds([40], [0])
    expected_ttft = prefill + handoff.seconds(2) + COST.step_seconds([8], [32])
    assert summary["ttft_ms"]["p50"] == pytest.approx(expected_ttft * 1e3)
    assert summary["tpot_ms"]["p50"] == pytest.approx(COST.step_seconds([1], [40]) * 1e3)
    assert summary["prefill_decode"]["blocks_loaded"] == 2 and summary["prefill_decode"]["prefill_steps"] == 1
    assert summary["goodput"]["met"] == 1 and summary["goodput"]["attainment"] == 1.0


def test_a_prompt_filling_its_blocks_exactly_loads_all_but_the_block_of_its_last_token(pm, config):
    summary, _ = simulate_disaggregated(config, pm, COST, [TraceRequest(0.0, 2, 48), TraceRequest(5.0, 2, 49)], 1,
                                        1, 0, math.inf, "least-loaded", None, KVHandoff())
    assert summary["prefill_decode"]["blocks_loaded"] == 2 + 3
    assert summary["completed"] == 2 and "goodput" not in summary


def test_apart_the_decode_streams_stop_stalling_behind_long_prompts_and_ttft_pays_for_it(pm, config):
    """DistServe's trade-off, on a mixed load: 1 prefill + 1 decode instance against 2 engines doing both, each
    instance as fast as each engine. Decoding no longer waits on long prefills (TPOT p99 falls); a short
    request's first token waits behind the prefill instance's long prompts (TTFT p99 rises)."""
    trace = mixed_trace()
    together, _ = simulate_once(config, pm, COST, trace, "fcfs", 2, 0, 2.0, slo=(2.0, 0.05))
    apart, _ = simulate_disaggregated(config, pm, COST, trace, 1, 1, 0, 2.0, "least-loaded", None, KVHandoff(),
                                      slo=(2.0, 0.05))
    assert together["completed"] == apart["completed"] == len(trace)
    assert apart["tpot_ms"]["p99"] < 0.6 * together["tpot_ms"]["p99"]
    assert apart["ttft_ms"]["p99"] > together["ttft_ms"]["p99"]
    # every request's full prompt blocks but the last token's were loaded, none computed twice
    assert apart["prefill_decode"]["blocks_loaded"] == sum((r.prompt_len - 1) // 16 for r in trace)
    # under a TPOT target alone, apart has the higher goodput; under a TTFT target alone, together has
    tpot_only, ttft_only = (1e3, 0.05), (2.0, 1e3)
    goodput = {(slo, way): run(slo)[0]["goodput"]["attainment"] for slo in (tpot_only, ttft_only) for way, run in (
        ("apart", lambda slo: simulate_disaggregated(config, pm, COST, trace, 1, 1, 0, 2.0, "least-loaded", None,
                                                     KVHandoff(), slo=slo)),
        ("together", lambda slo: simulate_once(config, pm, COST, trace, "fcfs", 2, 0, 2.0, slo=slo)))}
    assert goodput[tpot_only, "apart"] > 0.99 > goodput[tpot_only, "together"] + 0.1
    assert goodput[ttft_only, "together"] > goodput[ttft_only, "apart"]


def test_a_request_the_prefill_instance_refuses_is_counted_failed_once(pm, config):
    too_long = TraceRequest(0.5, 4, config.model.max_model_len + 10)
    summary, _ = simulate_disaggregated(config, pm, COST, [TraceRequest(0.0, 4, 40), too_long], 1, 1, 0, math.inf,
                                        "least-loaded", None, KVHandoff(), slo=(1.0, 0.1))
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert summary["goodput"]["attainment"] == 0.5


def test_the_command_reports_each_split_beside_the_engine_with_goodput(tmp_path, capsys):
    trace_path, cost_path = tmp_path / "mixed.jsonl", tmp_path / "cost.json"
    save_trace(mixed_trace(60), trace_path)
    COST.save(cost_path)
    assert main(["simulate", "--trace", str(trace_path), "--cost-model", str(cost_path), "--no-rescale",
                 "--prefill-decode", "1:1", "1:2", "--ttft-slo-ms", "3000", "--tpot-slo-ms", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    labels = [run["label"] for run in result["runs"]]
    assert len(labels) == 3 and "1 prefill + 2 decode instances" in labels[2]
    assert all(run["goodput"]["tpot_slo_ms"] == 50 for run in result["runs"])
    assert [run["prefill_decode"]["decode_instances"] for run in result["runs"][1:]] == [1, 2]
    assert main(["simulate", "--trace", str(trace_path), "--cost-model", str(cost_path), "--no-rescale",
                 "--prefill-decode", "1:1", "--ttft-slo-ms", "3000", "--tpot-slo-ms", "50"]) == 0
    text = capsys.readouterr().out
    assert "1 prefill + 1 decode instances" in text and "Goodput (req/s)" in text


@pytest.mark.parametrize("flags, message", [
    (["--prefill-decode", "1-1"], "write P:D"),
    (["--prefill-decode", "0:2"], "at least one prefill and one decode"),
    (["--ttft-slo-ms", "100"], "give both targets"),
    (["--ttft-slo-ms", "100", "--tpot-slo-ms", "-1"], "give both targets"),
    (["--prefill-decode", "1:1", "--kv-block-load-ms", "-1"], "must be finite and >= 0"),
])
def test_bad_split_and_target_flags_are_named(tmp_path, capsys, flags, message):
    trace_path = tmp_path / "t.jsonl"
    save_trace(mixed_trace(3), trace_path)
    assert main(["simulate", "--trace", str(trace_path), "--no-rescale", *flags]) != 0
    assert message in capsys.readouterr().err
