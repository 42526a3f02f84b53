"""A step whose execution raises: requests keep their progress, a fault is pinned on the request that
causes it, and every other request finishes with the tokens of a clean run.

Faults are injected for real, mid-step: a forward hook on one decoder layer of the default model
raises after the layers before it have written their K/V.
"""

from __future__ import annotations

import pytest
from one_engine import OneEngine

from pagoda import LLM, SamplingParams
from pagoda.errors import StepFailedError
from pagoda.modeling.default_model import ensure_default_model

PROMPTS = [
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):",
    " ".join(f"Line {i}: the keeper counted {i * 7 % 13} ships." for i in range(1, 12)) + " In all,",
    "Hello",
]
MAX_TOKENS = 10


def make_llm(**kwargs) -> LLM:
    ensure_default_model()
    # a small budget: the long prompt is prefilled in chunks while the others decode
    return LLM(dtype="bfloat16", batch_invariant=True,
               disable_log_stats=False, max_model_len=512, max_num_batched_tokens=48, max_num_seqs=8,
               kv_cache_memory_bytes=32 << 20, cpu_threads=1, **kwargs)


class Fault:
    """Raises inside decoder layer ``layer`` whenever ``should_fail(step, input_ids)`` says so."""

    def __init__(self, llm: LLM, should_fail, layer: int = 5) -> None:
        self.step = 0
        self.should_fail = should_fail
        self.raised = 0
        self.input_ids = None
        engine = llm.engine
        engine.observers.append(self)
        model = engine.model
        self._handles = [
            model.register_forward_pre_hook(self._see_inputs),
            model.layers[layer].register_forward_hook(self._maybe_raise),
        ]

    def before_step(self, engine, sched) -> None:
        self.step += 1

    def after_step(self, engine, sched, result, seconds) -> None:
        pass

    def _see_inputs(self, module, args) -> None:
        self.input_ids = args[0]

    def _maybe_raise(self, module, args, output) -> None:
        if self.should_fail(self.step, self.input_ids):
            self.raised += 1
            raise RuntimeError(f"injected fault #{self.raised} at step {self.step}")

    def remove(self, llm: LLM) -> None:
        for handle in self._handles:
            handle.remove()
        llm.engine.observers.remove(self)


def submit(engine, prompts, params) -> list[str]:
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(engine.add_request(f"r{i}", prompt, params))
    return ids


def run_until_done(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


SPECULATIVE = {"ngram": {"method": "ngram", "num_speculative_tokens": 3},
               "self": {"method": "draft_model", "model": "self:layers=8", "num_speculative_tokens": 2}}


@pytest.fixture(scope="module")
def engines():
    """One engine alive at a time (each holds its own copy of the default model), released at the module's end:
    the plain one for the tests below, then one per speculative method."""
    engines = OneEngine({"plain": make_llm, **{method: (lambda spec=spec: make_llm(speculative_config=spec))
                                               for method, spec in SPECULATIVE.items()}})
    yield engines
    engines.close()


@pytest.fixture
def llm(engines):
    return engines.get("plain")


@pytest.fixture(scope="module")
def clean(engines):
    """Token ids of each request in a run without faults."""
    engine = engines.get("plain").engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    submit(engine, PROMPTS, params)
    return {rid: out.outputs[0].token_ids for rid, out in run_until_done(engine).items()}


def assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.num_blocks


def test_a_passing_fault_is_retried_within_the_step(llm, clean):
    fault = Fault(llm, lambda step, ids: step == 3 and fault.raised == 0)
    try:
        submit(llm.engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        done = run_until_done(llm.engine)
    finally:
        fault.remove(llm)
    assert fault.raised == 1
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == clean
    assert all(out.error is None for out in done.values())
    assert_idle(llm)


def test_a_step_that_fails_for_everyone_raises_and_leaves_every_request_as_it_was(llm, clean):
    fault = Fault(llm, lambda step, ids: step == 4)
    engine = llm.engine
    try:
        submit(engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        for _ in range(3):
            engine.step()
        before = {r.request_id: (list(r.output_token_ids), r.num_output_tokens) for r in engine.scheduler.requests.values()}
        assert any(tokens for tokens, _ in before.values())  # some are decoding, the long one is still in prefill
        with pytest.raises(StepFailedError) as info:
            engine.step()
        assert fault.raised >= 2  # the whole step, then each request alone
        assert "even run alone" in str(info.value) and "injected fault" in str(info.value)
        assert set(info.value.request_ids) <= {f"r{i}" for i in range(len(PROMPTS))}
        after = {r.request_id: (list(r.output_token_ids), r.num_output_tokens) for r in engine.scheduler.requests.values()}
        assert after == before
        done = run_until_done(engine)
    finally:
        fault.remove(llm)
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == clean
    assert_idle(llm)


def test_a_request_that_fails_alone_ends_with_an_error_and_the_others_finish(llm, clean):
    poison_prompt = "Tell me about the number 7777777"
    poison_ids = set(llm.engine.tokenizer.encode(poison_prompt)) - set(
        t for p in PROMPTS for t in llm.engine.tokenizer.encode(p)) - set(t for ids in clean.values() for t in ids)
    assert poison_ids
    poison = next(iter(poison_ids))
    fault = Fault(llm, lambda step, ids: ids is not None and bool((ids == poison).any()))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        submit(engine, PROMPTS, params)
        engine.add_request("poison", poison_prompt, params)
        done = run_until_done(engine)
    finally:
        fault.remove(llm)
    assert "injected fault" in done["poison"].error
    assert done["poison"].outputs[0].finish_reason == "error"
    assert {rid: out.outputs[0].token_ids for rid, out in done.items() if rid != "poison"} == clean
    assert engine.stats.finished_by_reason["error"] >= 1
    assert_idle(llm)


@pytest.mark.parametrize("method", list(SPECULATIVE))
def test_speculative_steps_recover_from_faults_too(method, clean, engines):
    llm = engines.get(method)
    fault = Fault(llm, lambda step, ids: step in (3, 6))
    engine = llm.engine
    try:
        submit(engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except StepFailedError:
                continue
            done.update({out.request_id: out for out in outputs if out.finished})
    finally:
        fault.remove(llm)
    assert fault.raised > 0
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == clean
    assert_idle(llm)
