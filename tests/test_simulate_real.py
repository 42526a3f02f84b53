"""pagoda simulate against the real engine: calibration times real steps, and --compare-real replays the
same trace through a real engine (a tiny random-weight model here) and reports the simulator's error."""

from __future__ import annotations

import json

import pytest

from pagoda.cli import main
from pagoda.plugins.entrypoints.simulate.cost_model import FEATURES, CostModel
from pagoda.plugins.entrypoints.simulate.trace import TraceRequest, save_trace
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def small_trace(n: int = 16) -> list[TraceRequest]:
    return [TraceRequest(i * 0.05, output_len=6 + i % 5, prompt_len=24 + 7 * i, priority=i % 2) for i in range(n)]


def test_calibrate_then_compare_real_reports_the_simulator_s_error_against_a_real_run(tiny_dir, tmp_path, capsys):
    trace_path = tmp_path / "trace.jsonl"
    save_trace(small_trace(), trace_path)
    # a KV cache of 64 MiB (half a million tokens of the tiny model), ample for the trace
    args = ["simulate", "--trace", str(trace_path), "--model", str(tiny_dir), "--load-format", "dummy",
            "--cpu-threads", "1", "--kv-cache-space", "0.0625", "--cost-model", str(tmp_path / "cm.json"), "--calibrate", "--quick-calibration",
            "--compare-real", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    # calibration timed real steps (its progress goes to stderr with --json) and fitted non-negative coefficients
    assert captured.err.count("calibrate:") == 3
    model = CostModel.load(tmp_path / "cm.json")
    assert model.meta["num_samples"] >= 15 and model.meta["dtype"]
    assert all(model.coefficients[name] >= 0 for name in FEATURES)
    assert model.coefficients["step"] > 0 or model.coefficients["prefill_tokens"] > 0
    # the runner's swap copies were timed, and the speed probe at the start, middle and end: the median is the
    # reference
    assert model.has_move_costs and model.move_seconds(64) > 0
    probe = model.meta["probe"]
    assert len(probe["seconds"]) == 3 and probe["reference_seconds"] == sorted(probe["seconds"])[1] > 0
    # the probe before the simulation is timed against that reference, not against the model's prediction
    speed = result["speed_probe"]
    assert speed["reference_seconds"] == probe["reference_seconds"] and speed["predicted_seconds"] > 0
    assert speed["scale"] == pytest.approx(speed["probe_seconds"] / speed["reference_seconds"])
    assert result["cost_model_scale"] == pytest.approx(speed["scale"])
    assert set(result["simulated_vs_real_unscaled"]) == set(result["simulated_vs_real"])
    simulated, real = result["runs"]
    assert simulated["label"] == "pagoda simulate: fcfs" and real["label"].startswith("real engine")
    assert simulated["completed"] == real["completed"] == 16 and real["failed"] == 0
    assert real["output_tokens"] == simulated["output_tokens"] == sum(r.output_len for r in small_trace())
    assert 0 < real["ttft_ms"]["p50"] <= real["e2e_ms"]["p50"]
    assert real["num_steps"] > 0 and real["kv_usage"]["max"] > 0
    errors = result["simulated_vs_real"]
    assert set(errors) >= {"request_throughput", "ttft_p50", "output_token_throughput"}
    # a tiny model's steps are mostly Python overhead the fit captures in its constant: within a factor of 3
    assert abs(errors["output_token_throughput"]) < 2
    # the real run's own steps, against the cost model, and refitted: the simulation's error without calibration
    check = result["step_time_check"]
    assert check["real_over_predicted_step_seconds"] > 0
    assert set(check["errors_with_model_fitted_to_real_steps"]) == set(errors)


def test_a_request_log_written_by_a_real_engine_replays_in_the_simulator(tiny_dir, tmp_path, capsys):
    from pagoda import LLM, SamplingParams
    from pagoda.cli import build_parser
    from pagoda.plugins.entrypoints.simulate.request_log import RequestLogWriter
    from pagoda.registry.plugin_manager import PluginManager

    assert build_parser().parse_args(["serve", "--request-log", "x.jsonl"]).request_log == "x.jsonl"
    log = tmp_path / "requests.jsonl"
    pm = PluginManager().load()
    writer = RequestLogWriter(log)
    pm.register(writer, "request-log")  # what `pagoda serve --request-log` does
    llm = LLM(model=str(tiny_dir), load_format="dummy", cpu_threads=1, kv_cache_memory_bytes=64 << 20,
              plugin_manager=pm)
    prompts = [{"prompt_token_ids": [200 + i] * (10 + i)} for i in range(5)]
    llm.generate(prompts, [SamplingParams(max_tokens=3 + i, ignore_eos=True) for i in range(5)], use_tqdm=False,
                 priority=[i % 2 for i in range(5)])
    writer.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(line["num_output_tokens"] for line in lines) == [3, 4, 5, 6, 7]
    assert all(0 <= line["queue"] <= line["ttft"] <= line["e2e"] for line in lines)
    CostModel({name: 0.001 for name in FEATURES}).save(tmp_path / "cm.json")
    assert main(["simulate", "--from-request-log", str(log), "--model", str(tiny_dir), "--cost-model",
                 str(tmp_path / "cm.json"), "--load-format", "dummy", "--cpu-threads", "1", "--kv-cache-space",
                 "0.0625", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # the engine ran the speed probe's steps (three rounds of four requests); a model calibrated without a
    # probe reference is scaled by the probe's time over the model's prediction for its steps
    speed = result["speed_probe"]
    assert speed["reference_seconds"] is None and speed["predicted_seconds"] > 0
    assert speed["scale"] == pytest.approx(speed["probe_seconds"] / speed["predicted_seconds"])
    assert result["cost_model_scale"] == pytest.approx(speed["scale"]) and "recalibrate" in speed["note"]
    run = result["runs"][0]
    assert run["completed"] == 5 and run["output_tokens"] == 25 and run["prompt_tokens"] == sum(range(10, 15))
    assert set(run["ttft_ms_by_priority"]) == {"0", "1"}


def test_timing_the_swap_copies_leaves_the_kv_cache_and_the_swap_pool_size_as_they_were(tiny_dir):
    import torch

    from pagoda import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.plugins.entrypoints.simulate.calibrate import MOVE_SIZES, time_block_moves
    from pagoda.registry.plugin_manager import get_plugin_manager

    config = EngineArgs.build(model=str(tiny_dir), load_format="dummy", cpu_threads=1,
                              num_gpu_blocks_override=80).create_engine_config()
    engine = LLMEngine(config, get_plugin_manager())
    try:
        runner = engine.runner
        gen = torch.Generator().manual_seed(0)
        for cache in runner.kv_caches:
            cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
        before = [cache.clone() for cache in runner.kv_caches]
        samples = time_block_moves(runner)
        assert {n for n, _ in samples} == set(MOVE_SIZES) and all(s > 0 for _, s in samples)
        assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
        assert runner.num_swap_blocks == 0  # recompute mode: the pool borrowed for the timing is gone again
    finally:
        engine.shutdown()
