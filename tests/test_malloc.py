"""The allocator tuning that keeps large freed activations for reuse."""

import platform

import pytest

from pagoda.host.malloc import keep_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_accepts_the_thresholds():
    assert keep_freed_memory() is True



def _resident_mib() -> float:
    """This process's resident memory (Linux)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/statm")
def test_zero_pages_read_as_zeros_and_only_written_pages_become_resident():
    import torch

    from pagoda.host.malloc import zero_pages

    before = _resident_mib()
    cache = zero_pages((2, 4000, 16, 3, 64), torch.bfloat16)  # 47 MiB, a KV cache's layout
    assert cache.shape == (2, 4000, 16, 3, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert cache.count_nonzero().item() == 0  # read, never written: zero pages, none of them resident
    assert _resident_mib() - before < 8
    cache[:, 10:20] = 1.5  # a few blocks written (0.1 MiB)
    assert _resident_mib() - before < 8
    assert cache.float().sum().item() == 1.5 * 2 * 10 * 16 * 3 * 64
    cache.fill_(1.0)  # all of it written: all of it resident
    assert _resident_mib() - before > 40
    fp8 = zero_pages((4, 7, 3), torch.float8_e4m3fn)  # a 1-byte KV dtype, an odd size
    assert fp8.shape == (4, 7, 3) and fp8.float().abs().max().item() == 0
    assert zero_pages((0, 16), torch.float32).shape == (0, 16)
