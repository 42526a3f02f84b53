"""Importing pagoda changes nothing; an engine applies its process-wide host settings when built (HostTuning,
tested here without an engine) and checks them against the other engines of the process; its other settings
are its own."""

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pagoda.engine.engine_args import EngineArgs
from pagoda.host import settings as host
from pagoda.host import malloc, openmp
from pagoda.host.env import HostConfig
from pagoda.host.threads import available_cores

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose environment has no OpenMP wait variables (plus ``env``)."""
    environment = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES} | env
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result


IMPORT_AND_REPORT = """
import json, os, sys, threading
env_before, modules_before = dict(os.environ), set(sys.modules)
finders_before, hooks_before, threads_before = list(sys.meta_path), list(sys.path_hooks), threading.active_count()
import {module}
new = set(sys.modules) - modules_before
print(json.dumps({{"env_changed": dict(os.environ) != env_before, "new_modules": sorted(new),
                  "new_finders": [repr(f) for f in sys.meta_path if f not in finders_before],
                  "path_hooks_changed": sys.path_hooks != hooks_before,
                  "new_threads": threading.active_count() - threads_before}}))
"""


def _third_party(modules: list[str]) -> set[str]:
    return {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"pagoda"}


def test_importing_pagoda_changes_nothing_in_the_process():
    report = json.loads(run_python(IMPORT_AND_REPORT.format(module="pagoda")).stdout)
    assert report["env_changed"] is False
    assert report["new_finders"] == [] and report["path_hooks_changed"] is False  # no import machinery
    assert report["new_threads"] == 0
    # pluggy for the hookimpl marker a plugin imports (pagoda.hookimpl); no torch, no numpy
    assert _third_party(report["new_modules"]) <= {"pluggy"}
    assert "pagoda.host.malloc" not in report["new_modules"] and "pagoda.host.openmp" not in report["new_modules"]


def test_the_public_names_load_on_first_use():
    import pagoda

    assert pagoda.LLM.__name__ == "LLM" and pagoda.EngineArgs is EngineArgs
    assert set(pagoda.__all__) <= set(dir(pagoda))
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        pagoda.Engine  # noqa: B018


def test_a_program_chooses_the_wait_policy_before_importing_torch():
    out = run_python("import os, sys, pagoda.host.settings\n"
                     "assert 'torch' not in sys.modules\n"
                     "print(pagoda.host.settings.set_openmp_wait_policy('sleep'))\n"
                     "import torch\n"
                     "print(os.environ['OMP_WAIT_POLICY'], 'GOMP_SPINCOUNT' in os.environ)").stdout.splitlines()
    assert out == ["sleep (omp_wait_policy sleep)", "PASSIVE False"]


def test_the_wait_policy_defaults_to_its_variable():
    out = run_python("import os, pagoda.host.settings\npagoda.host.settings.set_openmp_wait_policy()\n"
                     "print(os.environ.get('GOMP_SPINCOUNT'))", PAGODA_OMP_WAIT_POLICY="spin").stdout
    assert out.strip() == openmp.SPIN_COUNT


def test_the_pagoda_command_chooses_the_wait_policy_before_torch_loads():
    code = ("import sys\n"
            "from pagoda import cli\nfrom pagoda.host import openmp\n"
            "choose = openmp.choose_wait_policy\n"
            "def spy(policy):\n"
            "    print('torch loaded:', 'torch' in sys.modules, 'policy:', policy, file=sys.stderr)\n"
            "    return choose(policy)\n"
            "openmp.choose_wait_policy = spy\n"
            "cli.main(['plugins'])\n"
            "print(openmp.set_here, file=sys.stderr)\n")
    err = run_python(code, PAGODA_OMP_WAIT_POLICY="sleep").stderr.splitlines()
    assert err == ["torch loaded: False policy: sleep", "{'OMP_WAIT_POLICY': 'PASSIVE'}"]


def test_once_torch_is_loaded_the_wait_policy_is_left_alone_and_a_warning_says_so(caplog):
    before = {name: os.environ.get(name) for name in WAIT_VARIABLES}
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        assert host.set_openmp_wait_policy("spin") == openmp.wait_policy
    assert {name: os.environ.get(name) for name in WAIT_VARIABLES} == before
    assert "before the first import of torch" in caplog.text


# ---- HostTuning -------------------------------------------------------------------------------------


@pytest.fixture
def engine_config(tmp_path):
    from tiny_models import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path))

    def build(**options):
        return EngineArgs(model=model, **options).create_engine_config()

    return build


def step(num_batched_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(num_batched_tokens=num_batched_tokens)


def test_a_set_thread_count_is_used_and_never_re_measured(engine_config):
    tuning = host.HostTuning(engine_config(cpu_threads=1, thread_recheck_seconds=0))
    assert tuning.num_threads == 1 == torch.get_num_threads() and tuning.governor is None
    tuning.after_step(None, step(8), object(), 0.01)
    assert tuning.num_threads == 1


@pytest.mark.skipif(available_cores() == 1, reason="one core: nothing to re-measure")
def test_a_measured_thread_count_is_re_measured_after_steps_that_ran_when_re_checks_are_on(monkeypatch, engine_config):
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    monkeypatch.setenv("PAGODA_THREAD_RECHECK_SECONDS", "1e-9")
    tuning = host.HostTuning(engine_config())
    assert tuning.governor is not None and tuning.governor.interval == 1e-9
    checks = []
    tuning.governor._measure = lambda: checks.append(1) or 1
    tuning.after_step(None, step(0), None, 0.0)  # nothing ran: nothing to learn
    assert checks == []
    tuning.after_step(None, step(8), object(), 0.01)
    tuning.after_step(None, step(8), object(), 0.01)
    assert len(checks) == 2 and tuning.num_threads == 1 == torch.get_num_threads()  # two checks agreed


@pytest.mark.skipif(available_cores() == 1, reason="one core: nothing to re-measure")
def test_held_threads_are_not_re_measured(monkeypatch, engine_config):
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    tuning = host.HostTuning(engine_config(thread_recheck_seconds=1e-9))
    tuning.governor._measure = lambda: pytest.fail("re-measured held threads")
    tuning.hold_threads()
    tuning.after_step(None, step(8), object(), 0.01)
    assert tuning.governor is None


def test_by_default_the_tuning_has_nothing_to_do_per_step(monkeypatch, engine_config):
    monkeypatch.delenv("PAGODA_THREAD_RECHECK_SECONDS", raising=False)
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    assert not host.HostTuning(engine_config(cpu_threads=1)).observes_steps  # huge pages on, the default
    assert not host.HostTuning(engine_config()).observes_steps  # a measured count is not re-checked


def test_an_engine_tunes_malloc_unless_its_setting_is_off(monkeypatch, engine_config):
    calls = []
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: calls.append(1) or True)
    host.HostTuning(engine_config(cpu_threads=1, malloc_tuning=False))
    assert calls == []
    host.HostTuning(engine_config(cpu_threads=1))
    assert calls == [1]


def test_a_wait_policy_asked_for_too_late_is_warned_about(monkeypatch, caplog, engine_config):
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: True)
    for name in WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(openmp, "set_here", {})
    monkeypatch.setattr(openmp, "requested_policy", None)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        host.HostTuning(engine_config(cpu_threads=1))  # auto: nothing was promised
        assert caplog.text == ""
        host.HostTuning(engine_config(cpu_threads=1, omp_wait_policy="sleep"))
    assert "omp_wait_policy='sleep' cannot take effect" in caplog.text
    assert "pagoda.host.settings.set_openmp_wait_policy('sleep') before importing torch" in caplog.text


def test_a_model_s_kernels_follow_its_own_settings_not_another_engine_s():
    from pagoda.modeling.layers.fused_ops import CpuKernels
    from pagoda.plugins.quant.base import kernel_for_device

    off = CpuKernels(HostConfig(fused_cpu_ops=False, onednn_packed_weights=False, cpu_isa="generic"))
    assert off.ops is None and off.gemv_path == "" and off.packs_weights is False
    assert off.isa_paths(torch.bfloat16) == {"rmsnorm/silu/rope": "torch", "dense linear": "torch"}
    x = torch.randn(2, 8).to(torch.bfloat16)
    w = torch.randn(4, 8).to(torch.bfloat16)
    assert torch.equal(off.linear(x, w), torch.nn.functional.linear(x, w))
    assert kernel_for_device("torch") == "torch"


def test_without_an_engine_kernels_follow_the_environment_as_it_is(monkeypatch):
    from pagoda.modeling.layers import fused_ops

    monkeypatch.setenv("PAGODA_FUSED_CPU_OPS", "off")
    assert fused_ops.cpu_ops() is None
    monkeypatch.setenv("PAGODA_QUANT_KERNEL", "torch")
    from pagoda.plugins.quant.base import kernel_for_device

    assert kernel_for_device() == "torch"


def test_an_engine_built_while_another_is_alive_shares_its_measured_thread_count(monkeypatch, engine_config):
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    first = host.HostTuning(engine_config(cpu_threads=1))
    monkeypatch.setattr("pagoda.host.threads.measure_best_threads", lambda *a, **k: pytest.fail("measured again"))
    second = host.HostTuning(engine_config())
    assert second.num_threads == first.num_threads == 1 == torch.get_num_threads()


def test_conflicting_process_wide_settings_of_a_second_engine_are_warned_about(monkeypatch, caplog, engine_config):
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: True)
    first = host.HostTuning(engine_config(cpu_threads=1))
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        host.HostTuning(engine_config(cpu_threads=1, huge_pages=False, fused_cpu_ops=False))  # per engine: no conflict
        assert caplog.text == ""
        second = host.HostTuning(engine_config(cpu_threads=2, malloc_tuning=False))
    assert ("cpu_threads=2 differs from the 1 compute threads of an engine already running in this process; torch's "
            "thread count is one per process, so that engine computes on 2 threads from now on too") in caplog.text
    assert "malloc_tuning=False cannot take effect: an engine already running in this process tuned" in caplog.text
    assert second.num_threads == 2 == torch.get_num_threads() and first is not None
    caplog.clear()
    del first, second
    import gc

    gc.collect()  # the engines are gone: nothing to conflict with
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        host.HostTuning(engine_config(cpu_threads=1))
    assert caplog.text == ""
