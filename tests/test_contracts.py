"""Core and the built-in commands touch a component only through its Protocol in pagoda.interfaces.

A plugin registers the built-in components again under other names, each wrapped in a proxy that
refuses any attribute its Protocol does not list. The engine then runs real workloads (batching,
chunked prefill, preemption, swap, prefix hits, aborts, speculation) with those names selected, and so
do the simulator (``pagoda simulate``: simulated and real replays, calibration) and the benchmarks
(``pagoda bench``): anything core, a built-in plugin or a command reaches outside a contract fails the
test, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams, hookimpl, interfaces
from pagoda.modeling.default_model import ensure_default_model
from pagoda.registry.plugin_manager import PluginManager
from pagoda.scheduling import SchedulingPolicy
from pagoda.testing.strict import ExecutorProxy, Proxy, QuantProxy


class ContractChecked:
    """Registers ``checked-<name>`` for each built-in component, wrapped in its Protocol's proxy."""

    def __init__(self, pm: PluginManager, seen: set) -> None:
        self.pm, self.seen = pm, seen

    def _wrap(self, hook: str, name: str, protocol: type, proxy: type = Proxy, new_name: str = ""):
        factory = self.pm.get(hook, name, hook).factory

        def make(*args):
            return proxy(factory(*args), protocol, self.seen)

        return {new_name or f"checked-{name}": make}

    @hookimpl
    def pagoda_model_architectures(self):
        return self._wrap("pagoda_model_architectures", "LlamaForCausalLM", interfaces.CausalLM,
                          new_name="CheckedLlamaForCausalLM")

    @hookimpl
    def pagoda_model_loaders(self):
        return self._wrap("pagoda_model_loaders", "safetensors", interfaces.ModelLoader)

    @hookimpl
    def pagoda_quant_methods(self):
        return self._wrap("pagoda_quant_methods", "fp8", interfaces.QuantMethod, QuantProxy)

    @hookimpl
    def pagoda_kv_allocators(self):
        return self._wrap("pagoda_kv_allocators", "paged", interfaces.KVCacheManager)

    @hookimpl
    def pagoda_schedulers(self):
        return {**self._wrap("pagoda_schedulers", "fcfs", SchedulingPolicy),
                **self._wrap("pagoda_schedulers", "priority", SchedulingPolicy)}

    @hookimpl
    def pagoda_attention_backends(self):
        return self._wrap("pagoda_attention_backends", "cpu", interfaces.AttentionBackend)

    @hookimpl
    def pagoda_samplers(self):
        return self._wrap("pagoda_samplers", "default", interfaces.Sampler)

    @hookimpl
    def pagoda_executors(self):
        return self._wrap("pagoda_executors", "uni", interfaces.Executor, ExecutorProxy)

    @hookimpl
    def pagoda_lora_backends(self):
        return {**self._wrap("pagoda_lora_backends", "torch", interfaces.LoRABackend),
                **self._wrap("pagoda_lora_backends", "cpu", interfaces.LoRABackend)}

    @hookimpl
    def pagoda_proposers(self):
        return {**self._wrap("pagoda_proposers", "ngram", interfaces.Proposer),
                **self._wrap("pagoda_proposers", "draft_model", interfaces.Proposer)}


@pytest.fixture
def seen():
    """The contract violations of one test, checked when it ends."""
    violations: set[str] = set()
    yield violations
    assert not violations, "\n".join(sorted(violations))


@pytest.fixture(scope="module")
def checked_model_dir(tmp_path_factory) -> str:
    """The default model, its config naming the proxied architecture (the files are links)."""
    source = Path(ensure_default_model())
    target = tmp_path_factory.mktemp("checked-model")
    for path in source.iterdir():
        if path.name != "config.json":
            (target / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["CheckedLlamaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def tiny_checked_model_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama as real safetensors files, its config naming the proxied architecture: for the
    commands' paths, where the model's size does not matter."""
    from tiny_models import write_tiny_llama

    target = tmp_path_factory.mktemp("tiny-checked-model")
    write_tiny_llama(target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["CheckedLlamaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def checked_plugin_manager(seen: set) -> PluginManager:
    pm = PluginManager().load()
    pm.register(ContractChecked(pm, seen), name="contract-checked")
    return pm


def checked_llm(seen: set, model: str, **kwargs) -> LLM:
    options = dict(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                   cpu_threads=1, kv_allocator="checked-paged", scheduling_policy="checked-fcfs",
                   attention_backend="checked-cpu", sampler="checked-default", load_format="checked-safetensors",
                   distributed_executor_backend="checked-uni",
                   # 64 MiB (the default model's ~1,400 tokens), ample for these requests
                   kv_cache_memory_bytes=64 << 20)
    options.update(kwargs)
    return LLM(plugin_manager=checked_plugin_manager(seen), **options)


PROMPTS = ["The capital of France is", "import numpy as np\n\ndef softmax(x):",
           " ".join(f"Line {i}: the keeper counted {i * 7 % 13} ships." for i in range(1, 12)), "Hello"]


def test_recompute_preemption_prefix_hits_n_and_logprobs_stay_inside_the_contracts(seen, checked_model_dir):
    # a pool this small forces preemption; repeated prompts hit the prefix cache
    llm = checked_llm(seen, checked_model_dir, kv_cache_memory_bytes=8 << 20)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, n=2, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=6, stop=["\n"]),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, presence_penalty=0.5)]
    outputs = llm.generate(PROMPTS * 2, params * 2, use_tqdm=False)
    assert all(o.finished for o in outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.stats.hits > 0
    engine = llm.engine
    engine.add_request("gone", PROMPTS[2], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("gone")
    assert not engine.has_unfinished_requests()


def test_swap_and_priority_stay_inside_the_contracts(seen, checked_model_dir):
    llm = checked_llm(seen, checked_model_dir, kv_cache_memory_bytes=8 << 20, preemption_mode="swap", swap_space=0.01,
                      scheduling_policy="checked-priority")
    swaps = []

    class SwapCounter:
        def before_step(self, engine, sched):
            swaps.extend(sched.blocks_to_swap_out)

        def after_step(self, engine, sched, result, seconds):
            pass

    llm.engine.observers.append(SwapCounter())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS * 2, params, priority=[0, 1, 2, 3, 3, 2, 1, 0], use_tqdm=False)
    assert all(o.finished for o in outputs)
    assert swaps


@pytest.mark.parametrize("spec", [{"method": "checked-ngram", "num_speculative_tokens": 3},
                                  {"method": "checked-draft_model", "model": "self:layers=8",
                                   "num_speculative_tokens": 2}])
def test_speculation_stays_inside_the_contracts(seen, checked_model_dir, spec):
    llm = checked_llm(seen, checked_model_dir, speculative_config=spec)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert all(o.finished for o in outputs)


@pytest.mark.parametrize("lora_backend", ["checked-torch", "checked-cpu"])
def test_lora_adapters_in_a_mixed_batch_stay_inside_the_contracts(seen, tiny_checked_model_dir, tmp_path,
                                                                   lora_backend):
    from lora_helpers import make_adapter

    from pagoda import LoRARequest
    from pagoda.engine.metrics import PrometheusExporter

    adapters = [make_adapter(Path(tiny_checked_model_dir), tmp_path / name, seed=i, r=4, alpha=8)
                for i, name in enumerate(("a", "b"))]
    llm = checked_llm(seen, tiny_checked_model_dir, enable_lora=True, max_loras=1, max_lora_rank=4,
                      lora_backend=lora_backend, kv_cache_memory_bytes=8 << 20)
    loras = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(zip("ab", adapters))]
    outputs = llm.generate(PROMPTS * 2, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           lora_request=[loras[0], None, loras[1], loras[0], None, loras[1], loras[0], None],
                           use_tqdm=False)
    assert all(o.finished for o in outputs)
    text = PrometheusExporter.for_engine(llm.engine).render().decode()
    assert "pagoda:lora_requests_info" in text


def test_the_server_metrics_stay_inside_the_contracts(seen, checked_model_dir):
    from pagoda.engine.metrics import PrometheusExporter

    llm = checked_llm(seen, checked_model_dir)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    text = PrometheusExporter.for_engine(llm.engine).render().decode()
    assert "pagoda:num_requests_running" in text and "pagoda:kv_cache_usage_perc" in text


def test_a_quantized_model_stays_inside_the_contracts(seen, checked_model_dir):
    llm = checked_llm(seen, checked_model_dir, quantization="checked-fp8")
    outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert all(o.finished for o in outputs)


# ---- the simulator (pagoda simulate) ----------------------------------------------------------------


def test_the_simulator_stays_inside_the_contracts(seen):
    from pagoda import EngineArgs
    from pagoda.plugins.entrypoints.simulate.cost_model import CostModel
    from pagoda.plugins.entrypoints.simulate.report import summarize_run
    from pagoda.plugins.entrypoints.simulate.simulator import build_engines, least_loaded, run_trace
    from pagoda.plugins.entrypoints.simulate.trace import TraceRequest

    config = EngineArgs.build(kv_allocator="checked-paged", scheduling_policy="checked-priority",
                              num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.05,
                              max_model_len=512).create_engine_config()
    cost = CostModel({"step": 0.01, "decode_step": 0.005, "prefill_tokens": 0.001, "decode_seqs": 0.002,
                      "decode_context": 0.0, "prefill_attention": 0.0})
    # a small pool preempts and swaps; shared prefixes hit the cache; the last prompt cannot fit the context
    trace = [TraceRequest(0.01 * i, output_len=60, prompt_len=60, priority=i % 2, prefix_group=i % 3,
                          prefix_len=32) for i in range(16)]
    trace.append(TraceRequest(0.2, output_len=4, prompt_len=600))
    engines, record = build_engines(config, checked_plugin_manager(seen), cost, trace, num_replicas=2)
    run_trace(trace, engines, least_loaded)
    summary = summarize_run(record, float("inf"), "checked-priority")
    assert summary["completed"] == 16 and "maximum context length is 512" in record.errors[16]
    assert summary["preemptions"] > 0 and summary["swapped_out_requests"] > 0 and record.prefix_hits > 0


def test_the_real_replay_and_the_calibration_stay_inside_the_contracts(seen, tiny_checked_model_dir):
    from pagoda.plugins.entrypoints.simulate.calibrate import time_block_moves
    from pagoda.plugins.entrypoints.simulate.real import replay_real
    from pagoda.plugins.entrypoints.simulate.trace import PromptMaker, TraceRequest

    llm = checked_llm(seen, tiny_checked_model_dir, kv_cache_memory_bytes=2 << 20, preemption_mode="swap",
                      swap_space=0.01)
    trace = [TraceRequest(0.0, output_len=8, prompt_len=40, prefix_group=0, prefix_len=32) for _ in range(3)]
    record, samples = replay_real(llm.engine, trace, PromptMaker(llm.engine.config.model.vocab_size))
    assert list(record.num_output) == [8, 8, 8] and samples and record.prefix_hits > 0
    assert {n for n, _ in time_block_moves(llm.engine.runner)} == {1, 4, 16, 64}  # (blocks, seconds) of copies


# ---- the benchmarks (pagoda bench) ---------------------------------------------------------------------


def test_the_benchmarks_stay_inside_the_contracts(seen, tiny_checked_model_dir, capsys):
    from pagoda.plugins.entrypoints.bench.prefix import run_workload
    from pagoda.plugins.entrypoints.bench.profile import profile_decode
    from pagoda.plugins.entrypoints.bench.throughput import _print_header, kernel_isa_paths, run_pagoda
    from pagoda.plugins.entrypoints.bench.workloads import BenchRequest

    llm = checked_llm(seen, tiny_checked_model_dir, kv_cache_memory_bytes=2 << 20)
    requests = [BenchRequest(list(range(100 + i, 140 + i)), 6) for i in range(4)]
    _print_header(llm)
    assert "attention: cpu" in capsys.readouterr().out  # the backend's own name
    assert kernel_isa_paths(llm)["decode attention"]
    result, peak = run_pagoda(llm, requests)
    assert result.output_tokens == 24 and peak["blocks"] > 0
    assert profile_decode(llm, requests, num_steps=2)
    run = run_workload(llm, requests, "contracts")
    assert run.queries > 0
