"""The allocator tuning that keeps large freed activations for reuse."""

import platform

import pytest

from pagoda.malloc import keep_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_accepts_the_thresholds():
    assert keep_freed_memory() is True


def test_the_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGODA_MALLOC_TUNING", "0")
    assert keep_freed_memory() is False
