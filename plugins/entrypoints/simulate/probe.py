"""A short fixed speed probe of the machine, to rescale a cost model calibrated at another time.

A shared machine's speed drifts (other jobs take cores and memory bandwidth): steps timed during
``pagoda simulate --calibrate`` can be 0.7x to 2.3x the steps of a run minutes later. The probe is a
fixed piece of work shaped like an engine step's parts: small bf16 matrix products (the model's linear
layers at decode batch sizes), a copy through a tensor larger than the caches (streaming weights and
K/V from memory), and a loop of plain Python over lists and dicts (the scheduler, the allocator and
the sampler's bookkeeping). It runs on the cost model's thread count and takes about half a second on
an idle machine. Calibration runs it between the parts of its grid and stores the mean; at simulate
time it runs again and the cost model is scaled by ``now / calibration``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

# rounds of each part: sized so one probe takes about 0.5 s on the development machine when idle
NUM_ROUNDS = 3
GEMM_SHAPE = (16, 576, 1536)  # [tokens, hidden] @ [hidden, intermediate]: SmolLM2-135M's MLP at decode sizes
NUM_GEMMS = 120
COPY_ELEMENTS = 24 * 2 ** 20  # 48 MiB in bf16, larger than the last-level cache share of a core
NUM_COPIES = 4
NUM_PYTHON_ITEMS = 400_000


def run_probe(num_threads: Optional[int] = None, dtype: str = "bfloat16") -> float:
    """Wall seconds of the fixed probe on ``num_threads`` compute threads (the current count if None)."""
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        torch_dtype = torch.bfloat16
    m, k, n = GEMM_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch_dtype)
    w = torch.randn(k, n, generator=gen).to(torch_dtype)
    src = torch.ones(COPY_ELEMENTS, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    with _threads(num_threads), torch.inference_mode():
        torch.mm(x, w)  # first-call setup (kernel selection) stays out of the timing
        dst.copy_(src)
        started = time.perf_counter()
        for _ in range(NUM_ROUNDS):
            for _ in range(NUM_GEMMS):
                torch.mm(x, w)
            for _ in range(NUM_COPIES):
                dst.copy_(src)
            _python_work(NUM_PYTHON_ITEMS)
        return time.perf_counter() - started


def _python_work(num_items: int) -> int:
    """Bookkeeping-shaped interpreter work: appends, dict updates, attribute-free arithmetic."""
    table: dict[int, list[int]] = {}
    total = 0
    for i in range(num_items):
        blocks = table.setdefault(i % 512, [])
        blocks.append(i)
        if len(blocks) > 16:
            total += blocks.pop(0)
    return total


@contextmanager
def _threads(num_threads: Optional[int]) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_scale(cost_model) -> dict:
    """Run the probe on the cost model's thread count and compare with its calibration's probes.

    Returns ``scale`` (``now / calibration``; None when the model cannot be rescaled), ``probe_seconds``,
    ``reference_seconds`` and a ``note`` that says which. A model calibrated on another CPU is not
    rescaled: it describes that machine, and this one's speed says nothing about it.
    """
    from pagoda.plugins.entrypoints.simulate.cost_model import cpu_name

    meta = cost_model.meta
    reference = meta.get("probe_seconds")
    result = {"scale": None, "probe_seconds": None, "reference_seconds": None}
    if not reference:
        result["note"] = ("not rescaled: the cost model has no speed probe (calibrated before pagoda stored one); "
                          "recalibrate with `pagoda simulate --calibrate` to rescale it to the machine's speed")
        return result
    if meta.get("cpu") and meta["cpu"] != cpu_name():
        result["note"] = f"not rescaled: the cost model was calibrated on {meta['cpu']}, this is {cpu_name()}"
        return result
    now = run_probe(meta.get("threads"), meta.get("dtype", "bfloat16"))
    ref = sum(reference) / len(reference)
    result.update(scale=now / ref, probe_seconds=now, reference_seconds=ref,
                  note=f"speed probe {now:.3f} s now, {ref:.3f} s during calibration: cost model scaled by "
                       f"{now / ref:.2f}x")
    return result
