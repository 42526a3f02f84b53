"""contrib/moe-bench/compare_moe.py without vLLM (it is not installed here): a ``--quick`` run of pagoda and HF
transformers on the random 2-layer MoE, its bytes per decode token against the checkpoint's own tensors, and its
refusals."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "contrib" / "moe-bench" / "compare_moe.py"
_spec = importlib.util.spec_from_file_location("compare_moe", SCRIPT)
compare_moe = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # its dataclass looks it up
_spec.loader.exec_module(compare_moe)  # its imports are the standard library's: nothing runs


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-bench")
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-vllm", "--hf-dtypes", "bfloat16",
                          "--checkpoint-dir", str(root), "--output", str(root / "report.md")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    yield root, run.stdout
    shutil.rmtree(root)  # 0.6 GB of checkpoint


def test_a_quick_run_reports_the_cpu_bandwidth_and_both_engines_figures(quick_run):
    root, out = quick_run
    report = (root / "report.md").read_text()
    assert report.startswith("CPU: ") and "flags: " in report and "load average at the start: " in report
    assert re.search(r"reading \d+\.\d GB/s, copying \d+\.\d GB/s", report)
    # 2 layers x 8 active experts x 3 x 1024 x 512 bf16 weights
    assert "50.3 MB of expert weights (2 layers x 8 of 64 experts x 3 x 1024 x 512)" in report
    assert "the first 4 W1 requests" in report and "(time of 9 tokens - time of 1) / 8" in report
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| ")}
    pagoda = rows["pagoda, bfloat16"].split(" | ")
    assert float(pagoda[1]) > 0 and float(pagoda[2]) > 0
    hf = rows["transformers, bfloat16"].split(" | ")
    assert hf[1] == "not run" and float(hf[2]) > 0  # batch 1 only
    assert "the time of bfloat16's" in rows["pagoda bfloat16 / transformers"]
    assert "best vLLM" not in report and "vLLM" not in out.split("\n\n")[-1]
    assert (root / "moe2-bfloat16" / "config.json").exists() and not (root / "moe2-float32").exists()


def test_the_bytes_per_decode_token_count_every_tensor_a_token_reads(quick_run):
    from safetensors import safe_open

    root, _ = quick_run
    model = root / "moe2-bfloat16"
    config = json.loads((model / "config.json").read_text())
    experts, dense = compare_moe.decode_bytes(config, 2)
    num_experts, top_k = compare_moe.num_experts(config), config["num_experts_per_tok"]
    expert_bytes = other_bytes = 0
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            numel = 1
            for n in t.get_shape():
                numel *= n
            if ".experts." in name:
                expert_bytes += 2 * numel
            elif "embed_tokens" in name:
                other_bytes += 2 * config["hidden_size"]  # one row per token
            else:
                other_bytes += 2 * numel
    assert experts == expert_bytes * top_k // num_experts
    assert dense == other_bytes


def test_vllm_without_a_venv_is_refused_with_the_flag_to_pass(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert f"--vllm-venv {tmp_path}: there is no bin/python in it" in run.stderr and "--no-vllm" in run.stderr


def test_pagoda_is_compared_with_the_peer_s_better_dtype_in_each_workload():
    run = compare_moe.Run
    pagoda = run("pagoda", "bfloat16", output_tok_s=100.0, ms_per_token=10.0)
    vllm = [run("vLLM", "bfloat16", output_tok_s=50.0, ms_per_token=20.0),
            run("vLLM", "float32", output_tok_s=80.0, ms_per_token=30.0)]
    assert compare_moe.ratio_rows(pagoda, vllm, "best vLLM") == [
        "| pagoda bfloat16 / best vLLM | 1.25x of float32's (ahead) | 0.50x the time of bfloat16's (ahead) | |"]
    slower = run("pagoda", "bfloat16", output_tok_s=40.0, ms_per_token=40.0)
    assert compare_moe.ratio_rows(slower, [run("transformers", "float32", ms_per_token=25.0)], "transformers") == [
        "| pagoda bfloat16 / transformers | - | 1.60x the time of float32's (behind) | |"]
    assert compare_moe.ratio_rows(pagoda, [], "best vLLM") == []
