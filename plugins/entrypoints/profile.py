"""``--profile``: where the time of a decode step goes.

The engine's components are wrapped with timers for a few steady-state decode
steps (after every prefill has finished), then restored. Matmuls are the
model's linear layers and the LM head; attention includes the K/V write.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch

from pagoda.layers.linear import Linear
from pagoda.plugins.entrypoints.workloads import BenchRequest


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, category: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - start

        return timed


class _Patches:
    """Sets attributes and puts every one back as it was."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object, bool]] = []

    def set(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, getattr(obj, name), name in vars(obj)))
        setattr(obj, name, value)

    def restore(self) -> None:
        for obj, name, original, was_own in reversed(self._undo):
            if was_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self._undo.clear()


def profile_decode(llm, requests: list[BenchRequest], num_steps: int = 8) -> dict[str, float]:
    """Time ``num_steps`` decode steps of ``requests`` run together; prints and returns ms per step."""
    from pagoda.sampling_params import SamplingParams

    engine = llm.engine
    longest = max(r.output_len for r in requests)
    for i, r in enumerate(requests):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=longest, min_tokens=longest, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(not r.is_prefill_done for r in sched.running):
        engine.step()
    batch = sched.num_running
    timers = _Timers()
    patches = _Patches()
    model, runner, sched = engine.model, engine.runner, engine.scheduler
    for m in model.modules():
        if isinstance(m, Linear):
            patches.set(m, "forward", timers.wrap("matmul", m.forward))
    patches.set(model, "compute_logits", timers.wrap("matmul", model.compute_logits))
    patches.set(sched, "schedule", timers.wrap("scheduling", sched.schedule))
    patches.set(sched, "update", timers.wrap("scheduling", sched.update))
    patches.set(runner, "execute", timers.wrap("runner total", runner.execute))
    patches.set(runner, "sampler", timers.wrap("sampling", runner.sampler))
    backend = runner.backend
    patches.set(backend, "forward", timers.wrap("attention", backend.forward))
    patches.set(backend, "build_metadata", timers.wrap("attention metadata", backend.build_metadata))
    op = engine.output_processor
    patches.set(op, "detokenize", timers.wrap("detokenize + outputs", op.detokenize))
    patches.set(op, "make_outputs", timers.wrap("detokenize + outputs", op.make_outputs))
    start = time.perf_counter()
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        total = time.perf_counter() - start
        patches.restore()
        engine.abort_request([f"profile-{i}" for i in range(len(requests))])
        engine.step()
    s = timers.seconds
    model_other = s["runner total"] - s["matmul"] - s["attention"] - s["attention metadata"] - s["sampling"]
    rows = {
        "matmuls (linear layers + LM head)": s["matmul"],
        "attention (K/V write + kernel)": s["attention"],
        "other model ops + input building": model_other,
        "attention metadata": s["attention metadata"],
        "sampling": s["sampling"],
        "scheduling (schedule + update)": s["scheduling"],
        "detokenization + outputs": s["detokenize + outputs"],
    }
    rows["unaccounted (engine Python)"] = total - sum(rows.values())
    print(f"profile: {num_steps} decode steps at batch {batch}, {total / num_steps * 1e3:.1f} ms per step "
          f"({torch.get_num_threads()} threads)")
    for name, seconds in rows.items():
        print(f"  {name:<36} {seconds / num_steps * 1e3:8.2f} ms  {seconds / total:6.1%}")
    return {name: seconds / num_steps * 1e3 for name, seconds in rows.items()}
