"""contrib/pagoda-sjf, a real third-party plugin: pip-installed, selected by name, seen at work.

pip installs the package with ``--target`` into a temporary directory (so the shared
environment is never changed); that directory goes on ``sys.path`` here and on PYTHONPATH for
the console script, which is all an installed distribution needs for its entry points to be found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.registry.plugin_manager import PluginManager
from tiny_models import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
SJF_SOURCE = REPO / "contrib" / "pagoda-sjf"


@pytest.fixture(scope="module")
def sjf_site(tmp_path_factory):
    """contrib/pagoda-sjf installed by pip into a fresh directory, importable for this module's tests."""
    work = tmp_path_factory.mktemp("sjf")
    source = work / "src"
    shutil.copytree(SJF_SOURCE, source)  # the build writes build/ and *.egg-info next to the sources
    site = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        check=True, capture_output=True, text=True,
    )
    assert list(site.glob("pagoda_sjf-0.1.0.dist-info"))
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for name in [m for m in sys.modules if m == "pagoda_sjf" or m.startswith("pagoda_sjf.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def finish_order(llm: LLM, prompt_lengths: list[int]) -> list[int]:
    """Submit prompts of the given lengths in that order; return their lengths in the order they finish."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, n in enumerate(prompt_lengths):
        engine.add_request(f"len-{n}", {"prompt_token_ids": [100 + i] * n}, params)
    order = []
    while engine.has_unfinished_requests():
        order.extend(int(out.request_id.split("-")[1]) for out in engine.step() if out.finished)
    return order


def test_the_installed_plugin_registers_sjf_with_its_distribution(sjf_site):
    pm = PluginManager().load(disabled=set())
    component = pm.get("pagoda_schedulers", "sjf", "scheduling_policy")
    assert component.dist == "pagoda-sjf 0.1.0"
    assert component.plugin == "sjf"
    from pagoda.scheduling import SchedulingPolicy

    assert issubclass(component.factory, SchedulingPolicy)
    assert not pm.failures


def test_selecting_sjf_runs_short_prompts_before_a_long_one_submitted_first(sjf_site, tiny_dir):
    lengths = [120, 40, 5, 80, 20]
    llm = LLM(model=str(tiny_dir), load_format="dummy", scheduling_policy="sjf", max_num_seqs=1,
              kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    assert type(llm.engine.scheduler.policy).__name__ == "ShortestJobFirstScheduler"
    assert type(llm.engine.scheduler.policy).__module__ == "pagoda_sjf.scheduler"
    assert finish_order(llm, lengths) == sorted(lengths)
    # first come, first served on the same engine options keeps submission order: the policy made the difference
    fcfs = LLM(model=str(tiny_dir), load_format="dummy", scheduling_policy="fcfs", max_num_seqs=1,
               kv_cache_memory_bytes=4 << 20, cpu_threads=1)
    assert finish_order(fcfs, lengths) == lengths


def test_sjf_shows_up_in_pagoda_plugins_with_its_distribution(sjf_site, monkeypatch, capsys):
    # `pagoda plugins` through the console script's entry point in this process, whose sys.path has the site as
    # a subprocess's PYTHONPATH would (its plugin manager is loaded afresh; the command's own process is run in
    # tests/test_cli.py and tests/test_plugin_manager.py)
    from pagoda.cli import main

    monkeypatch.delenv("PAGODA_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("PAGODA_PLUGIN_AUTOLOAD", raising=False)
    capsys.readouterr()
    returncode = main(["plugins"])
    result = capsys.readouterr()
    assert returncode == 0, result.err
    rows = [line.split() for line in result.out.splitlines()]
    assert ["scheduler", "sjf", "sjf", "pagoda-sjf", "0.1.0", ">=0.10,<0.11"] in rows  # with its declared API range
    assert ["scheduler", "fcfs", "schedulers", "pagoda", "(built-in)", "-"] in rows


def test_disabling_the_plugin_by_name_hides_sjf(sjf_site, monkeypatch):
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "sjf")
    pm = PluginManager().load()
    assert "sjf" not in pm.names("pagoda_schedulers")
    assert "fcfs" in pm.names("pagoda_schedulers")


def test_the_plugin_s_own_tests_run_pagoda_s_conformance_kit_and_pass(sjf_site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sjf_site), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SJF_SOURCE / "tests")],
                            env=env, capture_output=True, text=True, timeout=300, cwd=sjf_site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
