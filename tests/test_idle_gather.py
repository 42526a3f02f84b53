"""The served engine, woken from idle, gathers requests sent together into its first step (--idle-gather-ms)."""

from __future__ import annotations

import asyncio

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.engine_args import EngineArgs

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, kv_cache_memory_bytes=64 << 20)


def first_step_requests(engine, idle_gather_ms: float, spacing_s: float) -> set[str]:
    """Hand in PROMPTS ``spacing_s`` apart to an idle served engine; the request ids the first step produced for."""
    steps: list[set[str]] = []
    step = engine.step_engine_outputs

    def recording_step():
        outputs = step()
        steps.append({o.request_id for o in outputs})
        return outputs

    async def main():
        aengine = AsyncLLMEngine(engine, idle_gather_ms=idle_gather_ms)
        aengine.start()
        try:
            streams = []
            for i, prompt in enumerate(PROMPTS):
                if i:
                    await asyncio.sleep(spacing_s)
                streams.append(aengine.generate(f"r{i}", prompt, PARAMS))
            for stream in streams:
                async for _ in stream:
                    pass
        finally:
            await aengine.shutdown()

    engine.step_engine_outputs = recording_step
    try:
        asyncio.run(main())
    finally:
        del engine.step_engine_outputs
    return steps[0]


def test_requests_sent_together_land_in_the_first_step(llm):
    assert first_step_requests(llm.engine, idle_gather_ms=250, spacing_s=0.02) == {"r0", "r1", "r2", "r3"}


def test_without_gathering_the_first_request_steps_alone(llm):
    assert first_step_requests(llm.engine, idle_gather_ms=0, spacing_s=0.1) == {"r0"}


def test_the_option_reaches_the_engine_and_rejects_negative_values(llm):
    assert EngineArgs().idle_gather_ms > 0
    assert AsyncLLMEngine(llm.engine).idle_gather_s == llm.engine.config.scheduler.idle_gather_ms / 1000
    config = EngineArgs(model=llm.engine.config.model.model, idle_gather_ms=7).create_engine_config()
    assert config.scheduler.idle_gather_ms == 7
    with pytest.raises(Exception, match="idle_gather_ms"):
        EngineArgs(idle_gather_ms=-1)
