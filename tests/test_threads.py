"""The compute thread count is a setting; without one it is measured. So is how idle threads wait."""

import os

import pytest
import torch

from pagoda import openmp
from pagoda.threads import available_cores, configure_threads, measure_best_threads


def test_explicit_thread_count_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_THREADS", "2")
    assert configure_threads(1) == 1
    assert torch.get_num_threads() == 1


def test_environment_sets_the_thread_count_when_no_option_is_given(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_THREADS", "1")
    assert configure_threads(None) == 1


def test_measured_default_is_one_thread_or_every_core(monkeypatch):
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    assert measure_best_threads() in (1, available_cores())
    assert configure_threads(None) in (1, available_cores())


@pytest.mark.parametrize("runnable,expected_env", [
    (0.0, {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}),
    (2.0, {"OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_openmp_threads_spin_on_an_idle_machine_and_sleep_on_a_busy_one(monkeypatch, runnable, expected_env):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(openmp, "runnable_processes", lambda: runnable)
    openmp.choose_wait_policy()
    for name, value in expected_env.items():
        assert os.environ[name] == value
    other = {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} - set(expected_env)
    assert not other & set(os.environ)


def test_a_wait_policy_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(openmp, "runnable_processes", lambda: 5.0)
    assert openmp.choose_wait_policy() == "user"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


def test_the_run_queue_is_read_from_proc_loadavg():
    # this process is excluded; the count is never negative where /proc exists
    assert openmp.runnable_processes(samples=3, interval=0.0) >= 0
