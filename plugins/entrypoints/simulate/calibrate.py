"""``pagoda simulate --calibrate``: time the real engine's steps over a grid of batch shapes and fit the
cost model to them.

The grid covers the shapes serving produces: single prompts of growing length (prefill alone),
batches of decoding requests at several context lengths (decode alone), and requests arriving while
others decode (prefill chunks mixed with decodes). Every prompt is distinct, so no step is shortened
by the prefix cache; each step is timed whole (schedule, execute, update, emit) by an engine observer.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

from pagoda.plugins.entrypoints.simulate.cost_model import CostModel, fit, step_features
from pagoda.plugins.entrypoints.simulate.trace import PromptMaker, TraceRequest
from pagoda.sampling_params import SamplingParams

# prompt lengths timed alone; (batch size, context) decode shapes, each decoding `decode_steps` steps after
# its prefill; (requests, prompt length) arriving every other step while the earlier ones decode
FULL_GRID = dict(prefill=(16, 64, 256, 512, 1024, 2048),
                 decodes=((1, 64), (4, 64), (16, 64), (32, 64), (64, 64), (1, 320), (8, 320), (24, 320),
                          (1, 768), (6, 768)),
                 mixed=((8, 128), (16, 384)), decode_steps=10)
QUICK_GRID = dict(prefill=(8, 32, 96), decodes=((1, 16), (4, 16), (1, 48), (4, 48)), mixed=((4, 24),),
                  decode_steps=3)


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
        for num_requests, prompt_len in grid["mixed"]:
            for k in range(num_requests):
                driver.add(prompt_len, 3 * num_requests)
                engine.step()
                engine.step()
            driver.drain()
    finally:
        engine.observers.remove(timer)
    cfg = engine.config
    meta = {"model": cfg.model.model, "dtype": str(cfg.model.dtype).removeprefix("torch."),
            "threads": engine.num_threads, "block_size": cfg.cache.block_size,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "calibration_seconds": round(time.perf_counter() - started, 1)}
    model = fit(timer.samples, meta)
    log(f"calibrate: {len(timer.samples)} steps in {meta['calibration_seconds']} s; fit median error "
        f"{model.meta['median_rel_error']:.1%}, p90 {model.meta['p90_rel_error']:.1%}")
    return model
