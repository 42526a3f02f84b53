"""``--profile``: where the time of a decode step goes.

For a few steady-state decode steps (after every prefill has finished), a
step observer adds up the engine's phase timings (``engine.last_step_timings``)
and the runner's (``runner.timings``), and forward hooks time the model's
linear layers and attention layers. Matmuls are the linear layers and the LM
head; attention includes the K/V write. Output processing (text and logprobs
from the step's new tokens) follows the step, outside it: it is timed apart.
Under a JSON schema the grammar mask has a row of its own: the engine filling
the step's bitmask, and the runner filling the rows after speculative drafts
and applying the mask to the logits.

With pipeline parallelism the driver runs the first stage: the engine's rows are that stage's, the time it
waits for the later stages to return the step's tokens has a row of its own, and a table per stage follows
(each stage's first rank): its compute, its hand-offs (a receive includes the wait for the stage before) and
its bubble, the share of the step it sat idle. With steps in flight (``--pipeline-batches-in-flight``) each
engine step schedules and submits the next step and commits an earlier one, so a stage's compute can fill what
was its bubble.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

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
        if sched.grammar_rows:  # the engine filled the step's bitmask (inside its execute phase)
            self.seconds["grammar fill"] += engine.structured_outputs.last_fill_seconds


def profile_decode(llm, requests: list[BenchRequest], num_steps: int = 8,
                   json_schema: Optional[dict] = None) -> dict[str, float]:
    """Time ``num_steps`` decode steps of ``requests`` run together (fewer if a JSON schema ends them all
    sooner); prints and returns ms per step."""
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

    engine = llm.engine
    longest = max(r.output_len for r in requests)
    if json_schema is None:
        params = SamplingParams(temperature=0.0, max_tokens=longest, min_tokens=longest, ignore_eos=True)
    else:  # the schema decides where each output ends
        params = SamplingParams(temperature=0.0, max_tokens=longest,
                                structured_outputs=StructuredOutputsParams(json=json_schema))
    for i, r in enumerate(requests):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    sched = engine.scheduler
    while sched.waiting or any(not r.is_prefill_done for r in sched.running):
        engine.step()
    batch = sched.num_running
    modules = _ModuleTimer(engine.model, {Linear: "matmul", Attention: "attention"})
    phases = _PhaseTotals()
    engine.observers.append(phases)
    before = {k: list(v) for k, v in distributed.collective_stats.items()}
    has_stages = engine.config.parallel.pipeline_parallel_size > 1 and hasattr(engine.executor, "stage_stats")
    stages_before = engine.executor.stage_stats() if has_stages else None
    output_seconds = 0.0
    steps_run = 0
    try:
        while steps_run < num_steps and engine.has_unfinished_requests():
            engine.step()
            steps_run += 1
            output_seconds += engine.last_step_timings.get("output", 0.0)
    finally:
        engine.observers.remove(phases)
        modules.close()
        engine.abort_request([f"profile-{i}" for i in range(len(requests))])
        while engine.has_unfinished_requests():  # pipeline steps still in flight end their aborts when collected
            engine.step()
    num_steps = max(1, steps_run)
    stages = _stage_seconds(engine, stages_before) if has_stages else None
    # the driver's wait for the later stages (its own stage's work is its runner's execute)
    waiting = phases.seconds["execute"] - stages[0]["execute"] if stages else 0.0
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
        "waiting for the later pipeline stages": waiting,
        "other model ops + input building": s["execute"] - m["matmul"] - m["attention"] - s["runner metadata"]
        - s["runner logits"] - s["runner sampling"] - s["runner draft"] - s["runner grammar"] - s["grammar fill"]
        - (collectives - in_matmuls) - waiting,
        "attention metadata": s["runner metadata"],
        "drafting (speculative decoding)": s["runner draft"],
        "grammar mask (fill + apply)": s["grammar fill"] + s["runner grammar"],
        "sampling": s["runner sampling"],
        "scheduling": s["schedule"],
        "update (commit, stops)": s["update"],
        "outputs (new tokens per request)": s["emit"],
        "output processing (text, logprobs)": output_seconds,
    }
    if not calls:  # one rank
        del rows[collectives_row]
    if not stages:
        del rows["waiting for the later pipeline stages"]
    rows["unaccounted (engine Python)"] = total - sum(rows.values())
    print(f"profile: {num_steps} decode steps at batch {batch}"
          f"{' under a JSON schema' if json_schema is not None else ''}, {total / num_steps * 1e3:.1f} ms per step "
          f"({torch.get_num_threads()} threads)")
    for name, seconds in rows.items():
        print(f"  {name:<36} {seconds / num_steps * 1e3:8.2f} ms  {seconds / total:6.1%}")
    result = {name: seconds / num_steps * 1e3 for name, seconds in rows.items()}
    if stages:
        result.update(_print_stages(engine, stages, s["step"], num_steps))
    return result


def _stage_seconds(engine, before: list[dict]) -> list[dict[str, float]]:
    """Each stage's (its first rank's) seconds of execute, send and receive since ``before``."""
    after = engine.executor.stage_stats()
    tp = engine.config.parallel.tensor_parallel_size
    stages = []
    for rank in range(0, len(after), tp):
        stages.append({kind: after[rank].get(kind, (0, 0.0))[1] - before[rank].get(kind, (0, 0.0))[1]
                       for kind in ("execute", "send", "receive")})
    return stages


def _print_stages(engine, stages: list[dict[str, float]], step_seconds: float, num_steps: int) -> dict[str, float]:
    """The per-stage table: compute, hand-offs and bubble (idle share of the steps' wall time)."""
    partition = engine.config.parallel.pipeline_layer_partition
    compute = [st["execute"] - st["send"] - st["receive"] for st in stages]
    bubble = 1 - sum(compute) / (len(stages) * step_seconds) if step_seconds else 0.0
    parts = engine.config.parallel.pipeline_micro_batches
    in_flight = engine.most_steps_in_flight
    print(f"pipeline: {len(stages)} stages (layers {'/'.join(map(str, partition))}), "
          f"{'the step whole' if parts == 1 else f'steps in up to {parts} parts'}, "
          f"{'one step at a time' if in_flight == 1 else f'{in_flight} steps in flight'}; "
          f"bubble {bubble:.1%} of the stages' time")
    result = {"pipeline bubble fraction": bubble, "pipeline steps in flight": in_flight}
    for i, (st, busy) in enumerate(zip(stages, compute)):
        idle = 1 - busy / step_seconds if step_seconds else 0.0
        print(f"  stage {i}: compute {busy / num_steps * 1e3:7.2f} ms, send {st['send'] / num_steps * 1e3:6.2f} ms, "
              f"receive (with the wait) {st['receive'] / num_steps * 1e3:7.2f} ms, idle {idle:6.1%}")
        result[f"stage {i} compute"] = busy / num_steps * 1e3
        result[f"stage {i} send"] = st["send"] / num_steps * 1e3
        result[f"stage {i} receive"] = st["receive"] / num_steps * 1e3
    return result
