"""The compute thread count is a setting; without one it is measured. So is how idle threads wait."""

import os
import threading

import pytest
import torch

from pagoda.host import openmp
from pagoda.host.env import resolve_cpu_threads
from pagoda.host.threads import available_cores, configure_threads, measure_best_threads


def test_explicit_thread_count_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_THREADS", "2")
    assert configure_threads(resolve_cpu_threads(1)) == 1
    assert torch.get_num_threads() == 1


def test_environment_sets_the_thread_count_when_no_option_is_given(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_THREADS", "1")
    assert configure_threads(resolve_cpu_threads(None)) == 1


def test_measured_default_is_one_thread_or_every_core(monkeypatch):
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    assert resolve_cpu_threads(None) is None
    assert measure_best_threads() in (1, available_cores())
    assert configure_threads(None) in (1, available_cores())


@pytest.fixture
def no_choice_made_yet(monkeypatch):
    """This process's OpenMP choice as if none was made, restored after the test with the environment."""
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    monkeypatch.setattr(openmp, "set_here", {})
    monkeypatch.setattr(openmp, "requested_policy", None)
    monkeypatch.setattr(openmp, "wait_policy", openmp.wait_policy)
    yield
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(saved)


@pytest.mark.parametrize("runnable,expected_env", [
    (0.0, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}),
    (2.0, {"OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_openmp_threads_spin_on_an_idle_machine_and_sleep_on_a_busy_one(monkeypatch, no_choice_made_yet, runnable,
                                                                        expected_env):
    monkeypatch.setattr(openmp, "runnable_processes", lambda: runnable)
    openmp.choose_wait_policy()
    for name, value in expected_env.items():
        assert os.environ[name] == value
    other = {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} - set(expected_env)
    assert not other & set(os.environ)


@pytest.mark.parametrize("policy,expected_env", [
    ("spin", {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}),
    ("sleep", {"OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_a_wait_policy_asked_for_is_taken_whatever_the_load(monkeypatch, no_choice_made_yet, policy, expected_env):
    monkeypatch.setattr(openmp, "runnable_processes", lambda: pytest.fail("measured a policy that was given"))
    assert openmp.choose_wait_policy(policy).endswith(f"(omp_wait_policy {policy})")
    assert {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ} == expected_env
    assert openmp.requested_policy == policy


def test_choosing_again_replaces_the_earlier_choice_not_adds_to_it(no_choice_made_yet):
    openmp.choose_wait_policy("sleep")
    openmp.choose_wait_policy("spin")
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPIN_COUNT and "OMP_WAIT_POLICY" not in os.environ


def test_a_wait_policy_the_user_set_is_left_alone(monkeypatch, no_choice_made_yet):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(openmp, "runnable_processes", lambda: 5.0)
    assert openmp.choose_wait_policy() == "user"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_busy_user_process_counts_as_runnable_and_this_process_does_not():
    import subprocess
    import sys
    import time

    before = openmp.runnable_processes(samples=3, interval=0.0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert openmp.runnable_processes(samples=9, interval=0.005) >= 1
    finally:
        busy.kill()
        busy.wait()
    assert before >= 0


def test_kernel_threads_sleeping_tasks_and_this_process_are_not_counted(tmp_path):
    def task(pid: int, tid: int, comm: str, state: str, flags: int) -> None:
        d = tmp_path / str(pid) / "task" / str(tid)
        d.mkdir(parents=True)
        # pid (comm) state ppid pgrp session tty_nr tpgid flags ...
        (d / "stat").write_text(f"{tid} ({comm}) {state} 2 0 0 0 -1 {flags} 0 0 0 0\n")

    task(77, 77, "kdamond.0", "R", openmp._PF_KTHREAD | 0x40)  # a kernel thread, running
    task(500, 500, "python", "S", 0x400000)  # a sleeping user process
    task(500, 501, "worker (busy)", "R", 0x400040)  # its running thread; a comm with a ")" in it
    task(600, 600, "pagoda", "R", 0x400000)  # this process
    (tmp_path / "self").mkdir()  # not a pid
    assert openmp._runnable_user_tasks(600, proc=str(tmp_path)) == 1


def test_a_measured_thread_count_follows_the_machine_and_a_set_one_stays(monkeypatch):
    from pagoda.host.threads import ThreadGovernor

    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    assert ThreadGovernor.for_setting(resolve_cpu_threads(1), 1) is None  # --cpu-threads given
    monkeypatch.setenv("PAGODA_CPU_THREADS", "1")
    assert ThreadGovernor.for_setting(resolve_cpu_threads(None), 1) is None
    monkeypatch.delenv("PAGODA_CPU_THREADS")
    if available_cores() > 1:
        assert ThreadGovernor.for_setting(resolve_cpu_threads(None), 2, interval=7.0).interval == 7.0
        assert ThreadGovernor.for_setting(resolve_cpu_threads(None), 2, interval=0.0) is None  # re-checks off
    # the load changes between checks: every core, one hiccup, then one thread twice once others compete
    answers = iter([2, 1, 2, 1, 1])
    governor = ThreadGovernor(2, interval=0.0, measure=lambda: next(answers))
    assert governor.maybe_retune() == 2 and torch.get_num_threads() == 2
    assert governor.maybe_retune() == 2 and torch.get_num_threads() == 2  # one check is not enough
    assert governor.maybe_retune() == 2
    assert governor.maybe_retune() == 2
    assert governor.maybe_retune() == 1 and torch.get_num_threads() == 1
    waiting = ThreadGovernor(1, interval=3600.0, measure=lambda: pytest.fail("measured before the interval"))
    assert waiting.maybe_retune() == 1


def test_by_default_the_engine_keeps_its_measured_threads_and_observes_no_step_for_them(monkeypatch, tmp_path):
    from pagoda.engine.llm import LLM
    from tiny_models import write_tiny_checkpoint

    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    monkeypatch.delenv("PAGODA_THREAD_RECHECK_SECONDS", raising=False)
    llm = LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", kv_cache_memory_bytes=1 << 22,
              huge_pages=False)
    assert llm.engine.host.governor is None
    assert llm.engine.host not in llm.engine.observers  # nothing of the host layer runs per step


def test_the_engine_re_measures_its_threads_while_it_runs_when_asked_to(monkeypatch, tmp_path):
    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams
    from tiny_models import write_tiny_checkpoint

    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    monkeypatch.setenv("PAGODA_THREAD_RECHECK_SECONDS", "1e-9")
    llm = LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", kv_cache_memory_bytes=1 << 22)
    governor = llm.engine.host.governor
    if available_cores() == 1:
        assert governor is None
        return
    checks = []
    measure = governor._measure
    governor._measure = lambda: checks.append(1) or measure()
    llm.generate(["a b c"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(checks) >= 3  # every step, with an interval shorter than any step
    assert llm.engine.num_threads == torch.get_num_threads() in (1, available_cores())


def test_a_thread_that_releases_its_openmp_workers_computes_alone_and_leaves_the_others_theirs():
    """``release_thread_pool`` (what ``pagoda serve`` calls in the thread that built the engine) frees the calling
    thread's OpenMP workers: its later parallel regions run on it alone (OpenMP's own count for the thread; torch's
    ``get_num_threads`` answers with the process-wide setting), with the same results; other threads keep theirs."""
    from pagoda.host.openmp import libgomp, release_thread_pool

    gomp = libgomp()
    assert gomp is not None  # torch's OpenMP on Linux is libgomp
    before = gomp.omp_get_max_threads()
    x = torch.arange(200_000, dtype=torch.float32)
    seen = {}

    def work():
        seen["before"] = float((x * 2).sum())  # a parallel region: this thread now holds a pool of workers
        seen["released"] = release_thread_pool()
        seen["threads"] = gomp.omp_get_max_threads()
        seen["after"] = float((x * 2).sum())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"] is True
    assert seen["threads"] == 1 and seen["after"] == seen["before"]
    assert gomp.omp_get_max_threads() == before
