"""The ``pagoda`` console script, run for real in a subprocess: each command a user types (``plugins``,
``generate``, ``--version``; ``serve`` and ``bench`` in their own test files). The checks of what a command
answers to wrong flags or its ``--help`` call the same entry point in this process (``pagoda.cli.main``), with
its output and exit status as a subprocess's, since each process start costs seconds of imports."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_process import run_pagoda_here

from pagoda.modeling.default_model import ensure_default_model

PAGODA_SCRIPT = Path(sys.executable).with_name("pagoda")


def run_pagoda(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PAGODA_CPU_THREADS="1")
    env.pop("PAGODA_DISABLE_PLUGINS", None)
    env.pop("PAGODA_PLUGIN_AUTOLOAD", None)
    return subprocess.run([str(PAGODA_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def pagoda_here(capsys, monkeypatch):
    """``pagoda ARGS`` run by the console script's entry point in this process: a CompletedProcess with its exit
    status (argparse's exits included) and its output."""
    monkeypatch.delenv("PAGODA_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("PAGODA_PLUGIN_AUTOLOAD", raising=False)
    return functools.partial(run_pagoda_here, capsys)


def test_pagoda_plugins_lists_every_builtin_component_with_its_distribution():
    result = run_pagoda("plugins")
    assert result.returncode == 0, result.stderr
    from pagoda import PLUGIN_API_VERSION, __version__

    first, blank, header, *rows = result.stdout.splitlines()
    assert first == f"pagoda {__version__}, plugin API {PLUGIN_API_VERSION}" and not blank
    assert header.split() == ["KIND", "NAME", "PLUGIN", "DISTRIBUTION", "API"]
    for kind, name in [("scheduler", "fcfs"), ("scheduler", "priority"), ("sampler", "default"),
                       ("model loader", "safetensors"), ("model loader", "dummy"), ("KV allocator", "paged"),
                       ("attention backend", "torch"), ("model architecture", "LlamaForCausalLM"),
                       ("CLI command", "generate"), ("CLI command", "plugins"), ("tool-call parser", "hermes"),
                       ("tool-call parser", "llama3_json")]:
        matching = [row for row in rows if row.startswith(kind + " ") and row.split()[len(kind.split())] == name]
        assert len(matching) == 1, f"{kind} {name} is not listed once"
        assert matching[0].split()[-3:] == ["pagoda", "(built-in)", "-"]  # no declared API range


@pytest.mark.parametrize("flags, message", [
    (["--no-enable-auto-tool-choice", "--tool-call-parser", "hermes"], "--no-enable-auto-tool-choice turns tool-call "
                                                                       "parsing off"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermez"], "unknown tool-call parser 'hermez' for "
                                                                     "--tool-call-parser; available: 'hermes'"),
    (["--max-request-chars", "0"], "--max-request-chars 0: give a number of characters >= 1"),
    (["--reasoning-parser", "deepseek"], "unknown reasoning parser 'deepseek' for --reasoning-parser; available: "
                                         "'deepseek_r1'"),
])
def test_serve_refuses_wrong_server_flags_before_loading_the_model(flags, message, pagoda_here):
    result = pagoda_here("serve", "--port", "0", *flags)
    assert result.returncode != 0 and f"pagoda serve: error: {message}" in result.stderr, result.stderr


@pytest.mark.slow
def test_pagoda_generate_prints_the_prompt_and_its_continuation(pagoda_here):
    # in this process: the chat test below runs `pagoda generate` as its own process
    ensure_default_model()
    prompt = "The capital of France is"
    result = pagoda_here("generate", prompt, "--max-tokens", "8", "--dtype", "float32", "--kv-cache-space", "0.05")
    assert result.returncode == 0, result.stderr
    text = result.stdout.strip()
    assert text.startswith(prompt)
    assert "Paris" in text[len(prompt):]


@pytest.mark.slow
def test_pagoda_generate_chat_prints_only_the_answer_with_default_options():
    # no dtype: what `make demo` runs (bf16 on AVX2 and AVX-512 CPUs; the answer is far from any near-tie)
    ensure_default_model()
    result = run_pagoda("generate", "--chat", "What is the capital of France? Answer in one sentence.",
                        "--max-tokens", "32", "--kv-cache-space", "0.05")
    assert result.returncode == 0, result.stderr
    answer = result.stdout.strip()
    assert "Paris" in answer
    assert "<|im_start|>" not in answer and "user" not in answer.split()[0]


def test_an_unknown_plugin_name_on_the_command_line_is_a_clear_error_not_a_traceback(pagoda_here):
    ensure_default_model()
    result = pagoda_here("generate", "hi", "--scheduling-policy", "nope", "--max-tokens", "2")
    assert result.returncode == 2
    assert "pagoda generate: error: unknown scheduler 'nope'" in result.stderr
    assert "'fcfs' (pagoda (built-in))" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_directory_without_config_json_is_a_clear_error(tmp_path, pagoda_here):
    result = pagoda_here("generate", "hi", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "config.json" in result.stderr and str(tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_pagoda_without_a_command_prints_help_naming_the_commands(pagoda_here):
    result = pagoda_here()
    assert result.returncode == 2
    for command in ("generate", "plugins", "bench"):
        assert command in result.stdout


def test_pagoda_version_prints_the_package_version():
    from pagoda import __version__

    result = run_pagoda("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"pagoda {__version__}"


HOST_FLAGS = ["--cpu-threads", "--thread-recheck-seconds", "--omp-wait-policy", "--malloc-tuning",
              "--no-malloc-tuning", "--huge-pages", "--no-huge-pages", "--cpu-isa", "--cpu-native-build",
              "--no-cpu-native-build", "--fused-cpu-ops", "--no-fused-cpu-ops", "--onednn-packed-weights",
              "--no-onednn-packed-weights", "--cpu-prefill-kernel", "--no-cpu-prefill-kernel", "--quant-kernel"]


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "throughput"]])
def test_help_lists_every_host_option_with_its_environment_variable(command, pagoda_here):
    result = pagoda_here(*command, "--help")
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "host options:" in help_text
    for flag in HOST_FLAGS:
        assert flag in help_text, flag
    for variable in ("$PAGODA_CPU_THREADS", "$PAGODA_HUGE_PAGES", "$PAGODA_CPU_ISA", "$PAGODA_QUANT_KERNEL",
                     "$PAGODA_OMP_WAIT_POLICY", "$PAGODA_CPU_NATIVE", "$PAGODA_ONEDNN_PACKED"):
        assert variable in help_text, variable
    assert "{auto,generic,avx2,avx512,avx512_bf16}" in help_text and "{auto,spin,sleep}" in help_text


def test_a_flag_overrides_its_environment_variable(monkeypatch):
    import argparse

    from pagoda.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    monkeypatch.setenv("PAGODA_HUGE_PAGES", "1")
    monkeypatch.setenv("PAGODA_QUANT_KERNEL", "cpu")
    monkeypatch.setenv("PAGODA_FUSED_CPU_OPS", "off")
    args = engine_args_from(parser.parse_args(["--no-huge-pages", "--quant-kernel", "torch"]))
    settings = args.host_config()
    assert settings.huge_pages is False and settings.quant_kernel == "torch"
    assert settings.fused_cpu_ops is False  # no flag given: the variable
    assert engine_args_from(parser.parse_args(["--fused-cpu-ops"])).host_config().fused_cpu_ops is True


def test_a_malformed_host_variable_is_a_clear_error_not_a_traceback(tmp_path, pagoda_here, monkeypatch):
    # read before torch is imported: a process of its own
    env = dict(os.environ, PAGODA_OMP_WAIT_POLICY="fast")
    result = subprocess.run([str(PAGODA_SCRIPT), "plugins"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "PAGODA_OMP_WAIT_POLICY='fast' is not one of auto, spin, sleep" in result.stderr
    monkeypatch.setenv("PAGODA_HUGE_PAGES", "maybe")
    result = pagoda_here("generate", "hi", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "pagoda generate: error: PAGODA_HUGE_PAGES='maybe' is not a boolean" in result.stderr
    assert "Traceback" not in result.stderr
