"""Back the engine's large memory with 2 MiB transparent huge pages.

A decode step reads the weights and scattered KV blocks through 4 KiB pages,
hundreds of MiB of them: the TLB misses cost. Where the kernel leaves THP to
``madvise`` (the common default), an engine asks for huge pages on its KV cache
and its weights once, when it allocates them, before anything is written to
them, so that the first writes fault in 2 MiB pages; what was populated before
the advice is collapsed (``MADV_COLLAPSE``, Linux 6.1+), which copies it into
huge pages. The weights are advised before the loader writes them and
collapsed after it: advised only after loading, the copy of the default
model's float32 weights took 0.1-0.7 s of CPU at every start. The
paged-attention kernel alone ran 8-10% faster with huge pages. The heap that
holds a step's activations is not advised: that advice had to follow the heap
as steps grew it (a call after steps), and it is the whole process's heap, not
one engine's. The engine's
``huge_pages`` host setting off (``--no-huge-pages``, ``PAGODA_HUGE_PAGES=0``)
leaves its pages alone; failures (older kernels, THP disabled, non-Linux) are
ignored.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import time
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE_BYTES = 4096  # the smallest page: a write into each maps them all


_libc: Optional[ctypes.CDLL] = None


def _madvise():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        _libc = ctypes.CDLL(name, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def advise_range(start: int, end: int, collapse: bool = True) -> int:
    """Huge pages for the whole 2 MiB pages inside [start, end), and with ``collapse`` for those already populated
    there too (the kernel copies them). Returns the bytes advised (0 if none)."""
    lo = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    madvise = _madvise()
    if madvise is None or hi <= lo:
        return 0
    if madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        return 0
    if collapse:
        madvise(lo, hi - lo, _MADV_COLLAPSE)  # best effort; quick where the pages are huge already
    return hi - lo


def advise_tensors(tensors: Iterable[torch.Tensor], collapse: bool = True) -> int:
    """Huge pages for the storage of each CPU tensor (2 MiB pages wholly inside it), and with ``collapse`` for
    its pages already populated too. Returns bytes advised."""
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or t.is_mkldnn:  # a oneDNN-packed weight's memory is oneDNN's own
            continue
        storage = t.untyped_storage()
        total += advise_range(storage.data_ptr(), storage.data_ptr() + storage.nbytes(), collapse)
    return total


def populate(tensors: Iterable[torch.Tensor]) -> Optional[float]:
    """Have the kernel map every page of each contiguous CPU tensor now, as writes would, without changing its
    contents (``MADV_POPULATE_WRITE``; on a kernel without it a zero is written into each page, so the tensors
    must hold zeros). Returns the seconds it took, or None when the kernel refused (short of memory): the pages
    not mapped yet are then mapped on first use. Memory mapped on first touch (``malloc.zero_pages``) otherwise
    maps in the middle of whatever first writes there: on a VM a fresh 2 MiB page took some 8 ms to map."""
    import torch

    start = time.perf_counter()
    madvise = _madvise()
    for t in tensors:
        storage = t.untyped_storage()
        if madvise is not None and madvise(storage.data_ptr(), storage.nbytes(), _MADV_POPULATE_WRITE) == 0:
            continue
        if madvise is not None and ctypes.get_errno() != errno.EINVAL:  # EINVAL: a kernel older than the advice
            return None
        t.view(-1).view(torch.uint8)[::_PAGE_BYTES].zero_()
    return time.perf_counter() - start
