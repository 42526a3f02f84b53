"""The allocator tuning that keeps large freed activations for reuse."""

import platform

import pytest

from pagoda.host.malloc import keep_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_accepts_the_thresholds():
    assert keep_freed_memory() is True
