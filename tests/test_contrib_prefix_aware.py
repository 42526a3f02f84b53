"""contrib/pagoda-prefix-aware, a cache-aware scheduler as a third-party plugin: pip-installed, selected by
name, passing the conformance kit, and winning over fcfs on a shared-prefix trace, simulated and real.

pip installs the package with ``--target`` into a temporary directory (the shared environment is never
changed); that directory goes on ``sys.path`` here and on PYTHONPATH for subprocesses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.engine_args import EngineArgs
from pagoda.plugins.entrypoints.simulate.cost_model import CostModel
from pagoda.plugins.entrypoints.simulate.report import summarize_run
from pagoda.plugins.entrypoints.simulate.simulator import build_engines, run_trace
from pagoda.plugins.entrypoints.simulate.trace import PromptMaker, TraceRequest
from pagoda.registry.plugin_manager import PluginManager
from tiny_models import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "contrib" / "pagoda-prefix-aware"
COST = CostModel({"step": 0.01, "decode_step": 0.0, "prefill_tokens": 0.001, "decode_seqs": 0.002, "decode_context": 0.0,
                  "prefill_attention": 0.0})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    work = tmp_path_factory.mktemp("prefix_aware")
    shutil.copytree(SOURCE, work / "src")  # the build writes build/ and *.egg-info next to the sources
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(target), str(work / "src")],
                   check=True, capture_output=True, text=True)
    assert list(target.glob("pagoda_prefix_aware-0.1.0.dist-info"))
    sys.path.insert(0, str(target))
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m.split(".")[0] == "pagoda_prefix_aware"]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def pm(site):
    return PluginManager().load(disabled=set())


def interleaved_groups(num_requests: int = 48, num_groups: int = 4, prefix_len: int = 256) -> list[TraceRequest]:
    """A burst whose requests cycle through the groups: arrival order is the worst order for the cache."""
    return [TraceRequest(0.0, 8, prefix_len + 16, prefix_group=i % num_groups, prefix_len=prefix_len)
            for i in range(num_requests)]


def test_the_installed_package_registers_prefix_aware_with_its_distribution(pm):
    component = pm.get("pagoda_schedulers", "prefix-aware", "scheduling_policy")
    assert component.dist == "pagoda-prefix-aware 0.1.0"
    assert pm.api_ranges["prefix_aware"] == ">=0.10,<0.11"
    assert not pm.failures


def test_the_package_s_own_tests_run_the_conformance_kit_and_pass(site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SOURCE / "tests")],
                            env=env, capture_output=True, text=True, timeout=300, cwd=site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_in_the_simulator_it_beats_fcfs_on_hits_throughput_and_tail_ttft(pm):
    trace = interleaved_groups()
    runs = {}
    for policy in ("fcfs", "prefix-aware"):
        config = EngineArgs.build(scheduling_policy=policy, num_gpu_blocks_override=60,
                                  max_num_seqs=4).create_engine_config()
        engines, record = build_engines(config, pm, COST, trace)
        run_trace(trace, engines)
        runs[policy] = summarize_run(record, float("inf"), policy)
    fcfs, aware = runs["fcfs"], runs["prefix-aware"]
    assert fcfs["completed"] == aware["completed"] == len(trace)
    assert aware["prefix_cache_hit_rate"] > fcfs["prefix_cache_hit_rate"] + 0.3
    assert aware["request_throughput"] > 1.3 * fcfs["request_throughput"]
    assert aware["ttft_ms"]["p99"] < fcfs["ttft_ms"]["p99"]


def test_in_a_real_engine_it_reuses_more_cached_prefix_than_fcfs_as_simulated(pm, tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "tiny")
    trace = interleaved_groups(num_requests=24, num_groups=3, prefix_len=64)
    options = dict(model=str(model_dir), max_num_seqs=2, num_gpu_blocks_override=12, block_size=16)
    real, simulated = {}, {}
    for policy in ("fcfs", "prefix-aware"):
        llm = LLM(load_format="dummy", scheduling_policy=policy, cpu_threads=1, plugin_manager=pm, **options)
        policy_module = type(llm.engine.scheduler.policy).__module__
        assert policy_module.startswith("pagoda_prefix_aware") == (policy == "prefix-aware")
        prompts = PromptMaker(llm.engine.config.model.vocab_size)
        outputs = llm.generate([{"prompt_token_ids": prompts.tokens(i, r)} for i, r in enumerate(trace)],
                               SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
        stats = llm.engine.kv_manager.stats
        real[policy] = stats.hits / stats.queries
        # the same trace, all at once, simulated: the order of admissions does not depend on step times
        config = EngineArgs.build(scheduling_policy=policy, **options).create_engine_config()
        engines, record = build_engines(config, pm, COST, trace)
        run_trace(trace, engines)
        simulated[policy] = summarize_run(record, float("inf"), policy)["prefix_cache_hit_rate"]
    assert real["prefix-aware"] > real["fcfs"] + 0.3
    assert simulated == pytest.approx(real)
