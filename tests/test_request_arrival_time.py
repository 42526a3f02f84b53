"""A served request's arrival is when the server hands it to the engine, not when the engine thread next takes
commands: its queue time and TTFT in the metrics count the wait for the step that was running."""

from __future__ import annotations

import asyncio
import time

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine

HOLD_SECONDS = 0.5


def test_queue_time_and_ttft_count_the_wait_for_the_engine_thread():
    llm = LLM(dtype="bfloat16", batch_invariant=True,
              cpu_threads=1, kv_cache_memory_bytes=32 << 20, disable_log_stats=False)
    stats = llm.engine.stats

    async def main():
        aengine = AsyncLLMEngine(llm.engine)
        aengine.start()
        try:
            # the engine thread busy for HOLD_SECONDS, as in a long step, when the request comes in
            hold = asyncio.ensure_future(aengine.run_in_engine(lambda: time.sleep(HOLD_SECONDS)))
            await asyncio.sleep(0.05)
            start = time.monotonic()
            outs = [o async for o in aengine.generate("late", "The capital of France is",
                                                       SamplingParams(temperature=0.0, max_tokens=2))]
            await hold
            return outs, time.monotonic() - start
        finally:
            await aengine.shutdown()

    outs, elapsed = asyncio.run(main())
    assert outs[-1].finished
    assert stats.request_queue_time.count == 1 and stats.time_to_first_token.count == 1
    waited = HOLD_SECONDS - 0.05
    # the request waited for the held engine thread before it was scheduled
    assert waited * 0.9 <= stats.request_queue_time.sum <= elapsed
    assert stats.request_queue_time.sum <= stats.time_to_first_token.sum <= elapsed
