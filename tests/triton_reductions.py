"""Row reductions of pagoda's Triton kernels reduced by numpy under the Triton interpreter.

The kernels reduce each tile's rows with combine functions of their own (``triton_common.reduce_max`` and
``reduce_sum``: ``tl.reduce`` over ``_maximum`` and ``_add``, which follow the kernels' mode whenever triton was
imported). The interpreter knows only ``tl.max``'s and ``tl.sum``'s combine functions; any other it applies one
element at a time in Python, which is most of a kernel's time there. ``numpy_row_reductions`` has the interpreter
reduce with those two the way it reduces with its own: ``_maximum`` is ``tl.maximum``, NaN-ignoring (numpy's
``fmax``), ``_add`` a float32 sum. Everything else in the kernels runs as before. Without it (the default) the
interpreter calls the combine functions themselves, as at least one test does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np


@contextlib.contextmanager
def numpy_row_reductions() -> Iterator[None]:
    from triton.runtime import interpreter

    from pagoda.plugins.attention import triton_common

    ops = interpreter.ReduceOps
    original = ops.apply_impl

    def apply_impl(self, input):
        # looked up at each call: the backend defines its kernels again (a reload) when the mode changed
        combine = getattr(self.combine_fn, "fn", None)
        if combine is not None and combine is getattr(triton_common._maximum, "fn", None):
            return self.min_max(input[0], val_reduce_op=np.fmax.reduce)
        if combine is not None and combine is getattr(triton_common._add, "fn", None):
            return self.sum(input[0])
        return original(self, input)

    ops.apply_impl = apply_impl
    try:
        yield
    finally:
        ops.apply_impl = original
