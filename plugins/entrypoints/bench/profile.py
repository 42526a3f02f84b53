"""``--profile``: where the time of a decode step goes.

For a few steady-state decode steps (after every prefill has finished), a
step observer adds up the engine's phase timings (``engine.last_step_timings``)
and the runner's (``runner.timings``), and forward hooks time the model's
linear layers and attention layers. Matmuls are the linear layers and the LM
head; attention includes the K/V write. Output processing (text and logprobs
from the step's new tokens) follows the step, outside it: it is timed apart.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from pagoda.execution import distributed
from pagoda.modeling.layers.attention import Attention
from pagoda.modeling.layers.linear import Linear
from pagoda.plugins.entrypoints.bench.workloads import BenchRequest


class _ModuleTimer:
    """Adds up the time spent in every module of the given types, with forward hooks (removed by ``close``)."""

    def __init__(self, model: torch.nn.Module, categories: dict[type, str]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._handles = []
        for module in model.modules():
            category = next((c for t, c in categories.items() if isinstance(module, t)), None)
            if category is None:
                continue
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop_for(category)))

    def _start(self, module, args) -> None:
        module._profile_start = time.perf_counter()

    def _stop_for(self, category: str):
        def stop(module, args, output) -> None:
            self.seconds[category] += time.perf_counter() - module._profile_start
        return stop

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class _PhaseTotals:
    """A step observer adding up the engine's and the runner's timings of each step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def before_step(self, engine, sched) -> None:
        pass

    def after_step(self, engine, sched, result, seconds: float) -> None:
        self.seconds["step"] += seconds
        for name, value in engine.last_step_timings.items():
            self.seconds[name] += value
        if result is not None:
            for name, value in engine.runner.timings.items():
                self.seconds["runner " + name] += value


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
    modules = _ModuleTimer(engine.model, {Linear: "matmul", Attention: "attention"})
    phases = _PhaseTotals()
    engine.observers.append(phases)
    before = {k: list(v) for k, v in distributed.collective_stats.items()}
    output_seconds = 0.0
    try:
        for _ in range(num_steps):
            engine.step()
            output_seconds += engine.last_step_timings.get("output", 0.0)
    finally:
        engine.observers.remove(phases)
        modules.close()
        engine.abort_request([f"profile-{i}" for i in range(len(requests))])
        engine.step()
    s, m = phases.seconds, modules.seconds
    total = s["step"] + output_seconds
    # rank 0's collectives (tensor parallelism): inside the linear layers, the LM head and the embedding
    spent = {k: (v[0] - before.get(k, [0, 0.0])[0], v[1] - before.get(k, [0, 0.0])[1])
             for k, v in distributed.collective_stats.items()}
    collectives = sum(sec for _, sec in spent.values())
    calls = sum(n for n, _ in spent.values())
    in_matmuls = sum(sec for k, (_, sec) in spent.items() if k != "embedding")
    collectives_row = f"collectives ({calls // num_steps} per step, {distributed.current().comm_name})"
    rows = {
        "matmuls (linear layers + LM head)": m["matmul"] + s["runner logits"] - in_matmuls,
        collectives_row: collectives,
        "attention (K/V write + kernel)": m["attention"],
        "other model ops + input building": s["execute"] - m["matmul"] - m["attention"] - s["runner metadata"]
        - s["runner logits"] - s["runner sampling"] - s["runner draft"] - (collectives - in_matmuls),
        "attention metadata": s["runner metadata"],
        "drafting (speculative decoding)": s["runner draft"],
        "sampling": s["runner sampling"],
        "scheduling": s["schedule"],
        "update (commit, stops)": s["update"],
        "outputs (new tokens per request)": s["emit"],
        "output processing (text, logprobs)": output_seconds,
    }
    if not calls:  # one rank
        del rows[collectives_row]
    rows["unaccounted (engine Python)"] = total - sum(rows.values())
    print(f"profile: {num_steps} decode steps at batch {batch}, {total / num_steps * 1e3:.1f} ms per step "
          f"({torch.get_num_threads()} threads)")
    for name, seconds in rows.items():
        print(f"  {name:<36} {seconds / num_steps * 1e3:8.2f} ms  {seconds / total:6.1%}")
    return {name: seconds / num_steps * 1e3 for name, seconds in rows.items()}
