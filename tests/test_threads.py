"""The compute thread count is a setting; without one it is measured."""

import torch

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
