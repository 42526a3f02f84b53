"""``pagoda simulate --calibrate``: time the real engine's steps over a grid of batch shapes and fit the
cost model to them.

The grid covers the shapes serving produces: single prompts of growing length (prefill alone),
batches of decoding requests at several context lengths (decode alone), and requests arriving while
others decode (prefill chunks mixed with decodes). Every prompt is distinct, so no step is shortened
by the prefix cache; each step is timed whole (schedule, execute, update, emit) by an engine observer.

Calibration also times the runner's KV block copies between the cache and a swap pool (what
preemption by swapping does), fitted as seconds per step that moves blocks plus seconds per block.

:func:`measure_speed` is the speed probe: a few fixed steps of the real engine. Calibration runs it at
its start, middle and end and records the median time; later, the probe's time over that reference is
how much slower (or faster) the machine runs now than during calibration, and ``pagoda simulate``
scales the cost model by it. (For a model saved before the reference was recorded, the probe is
timed against the model's own prediction for its steps instead, which carries the fit's error at the
probe's shapes.)
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

from pagoda.plugins.entrypoints.simulate.cost_model import CostModel, cpu_name, fit, step_features
from pagoda.plugins.entrypoints.simulate.trace import PromptMaker, TraceRequest
from pagoda.sampling_params import SamplingParams

# prompt lengths timed alone; (batch size, context) decode shapes, each decoding `decode_steps` steps after
# its prefill; (requests, prompt length) arriving every other step while the earlier ones decode
FULL_GRID = dict(prefill=(16, 64, 256, 512, 1024, 2048),
                 decodes=((1, 64), (4, 64), (16, 64), (32, 64), (64, 256), (1, 320), (8, 320), (24, 320),
                          (1, 768), (6, 768)),
                 mixed=((8, 128), (16, 384)), decode_steps=10)
QUICK_GRID = dict(prefill=(8, 32, 96), decodes=((1, 16), (4, 16), (1, 48), (4, 48)), mixed=((4, 24),),
                  decode_steps=3)
# blocks moved at once when timing the runner's swap copies, each size out and back in this many times
MOVE_SIZES = (1, 4, 16, 64)
MOVE_REPEATS = 5
# the speed probe: this many requests of this many prompt tokens arrive together and generate this many tokens
# (one prefill step, then decodes of the whole batch), PROBE_ROUNDS times: 1.5 to 4 s on the default model
# at one thread; calibration runs it at its start, middle and end and records the median as the reference
PROBE_SHAPE = (4, 48, 16)
PROBE_ROUNDS = 3


class _StepTimer:
    """Engine observer: (features, seconds) of every step that ran requests."""

    def __init__(self) -> None:
        self.samples: list[tuple[tuple[float, ...], float]] = []

    def before_step(self, engine, sched) -> None:
        pass

    def after_step(self, engine, sched, result, seconds: float) -> None:
        if result is not None and sched.requests:
            self.samples.append((step_features(sched.num_new_tokens, sched.num_computed_before), seconds))


class _Driver:
    def __init__(self, engine, prompts: PromptMaker) -> None:
        self.engine = engine
        self.prompts = prompts
        # synthetic prompts are unique per index: a random range keeps a second calibration on the same
        # engine (or a trace replayed after it) from hitting this one's blocks in the prefix cache
        self.next_index = random.randrange(10 ** 9, 2 * 10 ** 9)

    def add(self, prompt_len: int, output_len: int) -> None:
        i = self.next_index
        self.next_index += 1
        ids = self.prompts.tokens(i, TraceRequest(0.0, output_len, prompt_len))
        self.engine.add_request(f"calibrate-{i}", {"prompt_token_ids": ids},
                                SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def calibrate(engine, grid: Optional[dict] = None, log: Callable[[str], None] = print) -> CostModel:
    """Time ``engine`` (an idle LLMEngine) over ``grid`` (default :data:`FULL_GRID`) and fit a cost model."""
    grid = grid or FULL_GRID
    max_len = engine.config.model.max_model_len
    prompts = PromptMaker(engine.config.model.vocab_size, seed=12345)
    driver = _Driver(engine, prompts)
    timer = _StepTimer()
    driver.add(64, 4)  # warm-up, not timed
    driver.drain()
    # the reference for later speed probes: the probe's time at the start, the middle and the end of the
    # calibration, so that it stands for the machine's speed over the same minutes as the fitted steps
    probes = [run_probe(engine)[0]]
    engine.observers.append(timer)
    started = time.perf_counter()
    try:
        for n in grid["prefill"]:
            if n < max_len:
                driver.add(n, 1)
                driver.drain()
        log(f"calibrate: prefill timed ({len(timer.samples)} steps, {time.perf_counter() - started:.0f} s)")
        for batch, context in grid["decodes"]:
            if context + grid["decode_steps"] < max_len:
                for _ in range(batch):
                    driver.add(context, grid["decode_steps"])
                driver.drain()
        log(f"calibrate: decode timed ({len(timer.samples)} steps, {time.perf_counter() - started:.0f} s)")
        engine.observers.remove(timer)
        probes.append(run_probe(engine)[0])
        engine.observers.append(timer)
        for num_requests, prompt_len in grid["mixed"]:
            for k in range(num_requests):
                driver.add(prompt_len, 3 * num_requests)
                engine.step()
                engine.step()
            driver.drain()
    finally:
        if timer in engine.observers:
            engine.observers.remove(timer)
    moves = time_block_moves(engine.runner)
    probes.append(run_probe(engine)[0])
    cfg = engine.config
    meta = {"model": cfg.model.model, "dtype": str(cfg.model.dtype).removeprefix("torch."), "cpu": cpu_name(),
            "threads": engine.num_threads, "block_size": cfg.cache.block_size,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "calibration_seconds": round(time.perf_counter() - started, 1),
            "block_moves": [[n, round(s, 7)] for n, s in moves],
            "probe": {"shape": list(PROBE_SHAPE), "rounds": PROBE_ROUNDS, "seconds": [round(s, 4) for s in probes],
                      "reference_seconds": round(sorted(probes)[1], 4)}}
    model = fit(timer.samples, meta)
    fixed, per_block = fit_block_moves(moves)
    model = CostModel(dict(model.coefficients, block_move_step=fixed, block_move=per_block), model.meta)
    log(f"calibrate: {len(timer.samples)} steps in {meta['calibration_seconds']} s; fit median error "
        f"{model.meta['median_rel_error']:.1%}, p90 {model.meta['p90_rel_error']:.1%}; block moves "
        f"{fixed * 1e3:.2f} ms + {per_block * 1e6:.1f} us a block; speed probe {sorted(probes)[1]:.3f} s")
    return model


def run_probe(engine) -> tuple[float, list[tuple[tuple[float, ...], float]]]:
    """:data:`PROBE_SHAPE` through ``engine`` (idle) :data:`PROBE_ROUNDS` times after one untimed warm-up
    request: the timed steps' total seconds and each step's (cost-model features, seconds)."""
    driver = _Driver(engine, PromptMaker(engine.config.model.vocab_size, seed=54321))
    timer = _StepTimer()
    num_requests, prompt_len, output_len = PROBE_SHAPE
    prompt_len = min(prompt_len, engine.config.model.max_model_len - output_len - 1)
    driver.add(prompt_len, 4)  # warm-up, not timed
    driver.drain()
    engine.observers.append(timer)
    try:
        for _ in range(PROBE_ROUNDS):
            for _ in range(num_requests):
                driver.add(prompt_len, output_len)
            driver.drain()
    finally:
        engine.observers.remove(timer)
    return sum(s for _, s in timer.samples), timer.samples


def probe_reference(cost_model: CostModel) -> Optional[float]:
    """The seconds the speed probe took during ``cost_model``'s calibration (the median of three), or None
    (a model saved before the reference was recorded, or one whose probe had another shape)."""
    probe = cost_model.meta.get("probe")
    if not isinstance(probe, dict) or probe.get("shape") != list(PROBE_SHAPE) or probe.get("rounds") != PROBE_ROUNDS:
        return None
    seconds = probe.get("reference_seconds")
    return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None


def measure_speed(engine, cost_model: CostModel) -> dict:
    """The speed probe (:func:`run_probe`) against its reference time recorded at calibration, or, for a
    model without one, against the cost model's prediction for the probe's steps.

    Returns ``scale`` (how many times slower the machine runs now; None when the model should not be
    rescaled), ``probe_seconds``, ``reference_seconds`` (the probe at calibration, or None),
    ``predicted_seconds`` (the model's prediction for the probe's steps) and a ``note``. A model calibrated
    on another CPU is not rescaled: it describes that machine, and this one's speed says nothing about it.
    """
    refusal = rescale_refusal(cost_model)
    if refusal:
        return {"scale": None, "probe_seconds": None, "reference_seconds": None, "predicted_seconds": None,
                "note": refusal}
    measured, samples = run_probe(engine)
    predicted = sum(cost_model.predict(f) for f, _ in samples)
    reference = probe_reference(cost_model)
    if reference is not None:
        scale = measured / reference
        note = (f"speed probe: {len(samples)} engine steps took {measured:.3f} s, {reference:.3f} s during "
                f"calibration: cost model scaled by {scale:.2f}x")
    else:
        scale = measured / predicted if predicted > 0 else None
        note = (f"speed probe: {len(samples)} engine steps took {measured:.3f} s, the cost model predicts "
                f"{predicted:.3f} s (it was saved before calibration recorded a probe of its own; recalibrate "
                f"for a steadier scale): cost model scaled by {scale:.2f}x" if scale else
                "not rescaled: the cost model predicts no time for the probe's steps")
    return {"scale": scale, "probe_seconds": measured, "reference_seconds": reference,
            "predicted_seconds": predicted, "note": note}


def time_block_moves(runner) -> list[tuple[int, float]]:
    """(blocks, seconds) of the runner's real swap copies: blocks 0..n-1 of the KV cache out to swap slots
    0..n-1 and back, which leaves the cache as it was. A runner without a large enough swap pool (no
    ``--preemption-mode swap``) gets one for the timing and has it shrunk back to its size afterwards."""
    from pagoda.step import SchedulerOutput

    sizes = [n for n in MOVE_SIZES if n <= runner.num_blocks]
    had = runner.num_swap_blocks
    if had < sizes[-1]:
        runner.allocate_swap_space(sizes[-1])
    samples = []
    try:
        for n in sizes:
            pairs = [(b, b) for b in range(n)]  # (cache block, swap slot) out; (swap slot, cache block) in
            for _ in range(MOVE_REPEATS):
                for sched in (SchedulerOutput(blocks_to_swap_out=pairs), SchedulerOutput(blocks_to_swap_in=pairs)):
                    t = time.perf_counter()
                    runner.move_blocks(sched)
                    samples.append((n, time.perf_counter() - t))
    finally:
        if had < sizes[-1]:
            runner.allocate_swap_space(had)
    return samples


def fit_block_moves(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per move, seconds per block), both >= 0, by least squares over the median time of each size."""
    import numpy as np

    sizes = sorted({n for n, _ in samples})
    medians = [float(np.median([s for m, s in samples if m == n])) for n in sizes]
    if len(sizes) < 2:
        return medians[0], 0.0
    per_block, fixed = np.polyfit(sizes, medians, 1)
    if fixed < 0:
        return 0.0, float(np.dot(sizes, medians) / np.dot(sizes, sizes))
    if per_block < 0:
        return float(np.mean(medians)), 0.0
    return float(fixed), float(per_block)


def rescale_refusal(cost_model: CostModel) -> Optional[str]:
    """Why ``cost_model`` should not be rescaled to this machine's speed (it was calibrated on another
    CPU), or None."""
    calibrated_on = cost_model.meta.get("cpu")
    if calibrated_on and calibrated_on != cpu_name():
        return f"not rescaled: the cost model was calibrated on {calibrated_on}, this is {cpu_name()}"
    return None
