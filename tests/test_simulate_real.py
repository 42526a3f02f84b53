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


def small_trace(n: int = 12) -> list[TraceRequest]:
    return [TraceRequest(i * 0.02, output_len=6 + i % 5, prompt_len=24 + 7 * i, priority=i % 2) for i in range(n)]


def test_calibrate_then_compare_real_reports_the_simulator_s_error_against_a_real_run(tiny_dir, tmp_path, capsys):
    trace_path = tmp_path / "trace.jsonl"
    save_trace(small_trace(), trace_path)
    args = ["simulate", "--trace", str(trace_path), "--model", str(tiny_dir), "--load-format", "dummy",
            "--cpu-threads", "1", "--cost-model", str(tmp_path / "cm.json"), "--calibrate", "--quick-calibration",
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
    simulated, real = result["runs"]
    assert simulated["label"] == "pagoda simulate: fcfs" and real["label"].startswith("real engine")
    assert simulated["completed"] == real["completed"] == 12 and real["failed"] == 0
    assert real["output_tokens"] == simulated["output_tokens"] == sum(r.output_len for r in small_trace())
    assert 0 < real["ttft_ms"]["p50"] <= real["e2e_ms"]["p50"]
    assert real["num_steps"] > 0 and real["kv_usage"]["max"] > 0
    errors = result["simulated_vs_real"]
    assert set(errors) >= {"request_throughput", "ttft_p50", "output_token_throughput"}
    # a tiny model's steps are mostly Python overhead the fit captures in its constant: within a factor of 3
    assert abs(errors["output_token_throughput"]) < 2
