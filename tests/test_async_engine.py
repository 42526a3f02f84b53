"""AsyncLLMEngine over the real default model: streaming, aborts, admission control, step faults."""

from __future__ import annotations

import asyncio

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, EngineStepError
from pagoda.errors import InvalidRequestError
from engine_helpers import wait_until_cache_is_free
from one_engine import release
from tiny_models import tiny_llm, write_tiny_checkpoint

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="bfloat16", batch_invariant=True,
              cpu_threads=1, kv_cache_memory_bytes=64 << 20, disable_log_stats=False)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm


@pytest.fixture(scope="module")
def reference(llm):
    return {p: out.outputs[0].text for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


def run(engine, coro_fn, **kwargs):
    """Start an AsyncLLMEngine over ``engine`` on a fresh loop, run ``coro_fn(async_engine)``, shut down."""

    async def main():
        aengine = AsyncLLMEngine(engine, **kwargs)
        aengine.start()
        try:
            return await coro_fn(aengine)
        finally:
            await aengine.shutdown()

    return asyncio.run(main())


async def collect(aengine, rid, prompt, params=GREEDY):
    outs = [out async for out in aengine.generate(rid, prompt, params)]
    return outs


def assert_engine_clean(engine, timeout=5.0):
    if not wait_until_cache_is_free(engine, timeout):
        raise AssertionError(f"{engine.num_blocks - engine.kv_manager.num_free_blocks} KV blocks still held")


def test_streamed_outputs_grow_token_by_token_and_end_as_offline_generate_does(llm, reference):
    outs = run(llm.engine, lambda a: collect(a, "s1", PROMPTS[0]))
    assert len(outs) == GREEDY.max_tokens  # one output per generated token
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].text == reference[PROMPTS[0]]


def test_concurrent_requests_share_steps_and_match_offline_results(llm, reference):
    steps_before = llm.engine.stats.num_steps

    async def main(a):
        return await asyncio.gather(*(collect(a, f"c{i}", p) for i, p in enumerate(PROMPTS)))

    results = run(llm.engine, main)
    assert {p: outs[-1].outputs[0].text for p, outs in zip(PROMPTS, results)} == reference
    # continuous batching: 4 requests x 8 tokens took far fewer than 32 steps
    assert llm.engine.stats.num_steps - steps_before < 20


def test_closing_the_stream_early_aborts_the_request_and_frees_its_blocks(llm):
    async def main(a):
        gen = a.generate("long", "Write a long story about a dragon.", SamplingParams(temperature=0, max_tokens=500))
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()
        await asyncio.sleep(0.5)
        return a.engine.has_unfinished_requests()

    assert run(llm.engine, main) is False
    assert_engine_clean(llm.engine)


def test_requests_past_max_waiting_requests_are_refused_with_retry_after(llm, reference):
    async def main(a):
        tasks = [asyncio.ensure_future(collect(a, f"o{i}", PROMPTS[i % 4])) for i in range(5)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(llm.engine, main, max_waiting_requests=2)
    refused = [r for r in results if isinstance(r, EngineOverloadedError)]
    accepted = [r for r in results if not isinstance(r, BaseException)]
    assert len(refused) == 3 and len(accepted) == 2
    assert all(r.retry_after >= 1 and "--max-waiting-requests" in str(r) for r in refused)
    assert [outs[-1].outputs[0].text for outs in accepted] == [reference[PROMPTS[0]], reference[PROMPTS[1]]]
    assert_engine_clean(llm.engine)


def test_an_invalid_request_raises_before_any_output_and_leaves_nothing_queued(llm):
    async def main(a):
        with pytest.raises(InvalidRequestError, match="empty"):
            await collect(a, "bad", [])
        return await collect(a, "good", PROMPTS[2])

    assert run(llm.engine, main)[-1].finished
    assert_engine_clean(llm.engine)


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(llm, reference, monkeypatch):
    executor = llm.engine.executor
    real_execute = executor.execute
    calls = {"n": 0}

    def execute_failing_third_step(sched):
        calls["n"] += 1
        if calls["n"] in (3, 4):  # the step and its retry
            raise RuntimeError("injected fault")
        return real_execute(sched)

    monkeypatch.setattr(executor, "execute", execute_failing_third_step)
    errors_before = llm.engine.stats.finished_by_reason["error"]

    async def main(a):
        with pytest.raises(EngineStepError, match="injected fault"):
            await collect(a, "f1", PROMPTS[0])
        after = await collect(a, "f2", PROMPTS[1])
        return a.is_healthy, a.num_failed_steps, after

    healthy, failed, after = run(llm.engine, main)
    assert healthy and failed == 1
    assert after[-1].outputs[0].text == reference[PROMPTS[1]]
    assert llm.engine.stats.finished_by_reason["error"] == errors_before + 1
    assert_engine_clean(llm.engine)


def test_steps_that_keep_failing_mark_the_engine_dead_and_fail_every_request(llm, monkeypatch):
    def always_fail(sched):
        raise RuntimeError("broken device")

    monkeypatch.setattr(llm.engine.executor, "execute", always_fail)

    async def main(a):
        errors = []
        for i in range(5):
            try:
                await collect(a, f"d{i}", PROMPTS[0])
            except (EngineStepError, EngineDeadError) as exc:
                errors.append(exc)
                if isinstance(exc, EngineDeadError):
                    break
        return a.is_healthy, errors

    healthy, errors = run(llm.engine, main, max_consecutive_failures=3)
    assert not healthy
    assert [type(e) for e in errors] == [EngineStepError] * 3 + [EngineDeadError]
    assert "broken device" in str(errors[-1])
    monkeypatch.undo()
    assert_engine_clean(llm.engine)


def test_shutdown_fails_unfinished_requests_and_stops_the_engine_thread(llm):
    async def main(a):
        task = asyncio.ensure_future(collect(a, "sd", PROMPTS[3], SamplingParams(temperature=0, max_tokens=400)))
        await asyncio.sleep(0.5)
        await a.shutdown(timeout=0.1)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await task
        with pytest.raises(EngineDeadError):
            await collect(a, "after", PROMPTS[0])
        return a._thread.is_alive()

    assert run(llm.engine, main) is False
    assert_engine_clean(llm.engine)


def test_a_crash_that_escapes_the_step_fails_waiting_clients_instead_of_hanging_them(llm, monkeypatch):
    class Crash(BaseException):
        pass

    def crash(sched):
        raise Crash("interpreter is going away")

    monkeypatch.setattr(llm.engine.executor, "execute", crash)

    async def main(a):
        with pytest.raises(EngineDeadError, match="crashed: Crash"):
            await asyncio.wait_for(collect(a, "x", PROMPTS[0]), timeout=30)
        return a.is_healthy

    assert run(llm.engine, main) is False
    monkeypatch.undo()
    assert_engine_clean(llm.engine)


def test_admission_counts_tokens_a_request_may_cost_not_only_requests(tmp_path):
    # --max-waiting-tokens 60: prompt plus max_tokens, times n, of the requests that have not started yet. What is
    # counted are tokens, not what the model makes of them: a tiny random model, not a second copy of the default
    small_llm = tiny_llm(write_tiny_checkpoint(tmp_path), dtype="float32", max_waiting_tokens=60)
    engine = small_llm.engine
    prompt = {"prompt_token_ids": [504, 3458, 314, 4649, 314]}  # 5 tokens

    async def main(aengine):
        with pytest.raises(InvalidRequestError, match=r"140 tokens .* at most 60 \(--max-waiting-tokens\)"):
            aengine.generate("huge", prompt, SamplingParams(max_tokens=30, n=4))
        first = aengine.generate("a", prompt, SamplingParams(max_tokens=40))  # 45 tokens, not started yet
        with pytest.raises(EngineOverloadedError, match="hold 45 tokens"):
            aengine.generate("b", prompt, SamplingParams(max_tokens=20))  # 25 more would make 70
        small = aengine.generate("c", prompt, SamplingParams(max_tokens=10))  # 15 more: 60 fits
        outs = [o async for o in first]
        assert outs[-1].finished and [o async for o in small][-1].finished
        # once started, a request no longer holds the queue
        return [o async for o in aengine.generate("d", prompt, SamplingParams(max_tokens=40))][-1]

    try:
        assert run(engine, main).finished
        assert_engine_clean(engine)
    finally:
        release(small_llm)
