"""Outputs as deltas: incremental text identical to a full decode, delta and final outputs that agree, and
output work linear in a request's length. The real default model's tokenizer, and its engine where one runs."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.components import load_tokenizer
from pagoda.modeling.default_model import ensure_default_model
from pagoda.outputs import (EngineOutput, IncrementalDetokenizer, OutputProcessor, RequestMetrics,
                            RequestOutputKind, SequenceDelta)

TEXTS = [
    "The capital of France is Paris, and it has been for a very long time.",
    "Grüße aus Köln! Ça va? naïve café — «guillemets» and ‘quotes’.",
    "東京タワーは高い。北京欢迎你！서울은 크다.",
    "Dragons 🐉 breathe fire 🔥🔥; emoji with joiners: 👩‍💻 and flags 🇫🇷.",
    "def f(x):\n    return x ** 2  # tabs\tand\nnewlines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(ensure_default_model()), None)


class CountingTokenizer:
    """The real tokenizer, counting the tokens it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_decoded_tokens = 0

    def decode(self, ids, **kwargs):
        self.num_decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_decoding_the_whole_output_non_ascii_included(tokenizer, text, chunk):
    prompt_ids = tokenizer.encode("Say it:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    seen = []
    for start in range(0, len(ids), chunk):
        detok.add_tokens(ids[start:start + chunk], may_stop=False)
        seen.append(detok.text)
        assert "\ufffd" not in detok.text  # half a character is never shown
    assert detok.text == tokenizer.decode(ids) == text
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


def engine_outputs(ids, logprobs=None, stop_at=None):
    """The engine's outputs of one sequence generating ``ids`` one token per step."""
    outs = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        reason = ("stop" if stop_at else "length") if last else None
        stop_reason = stop_at if last else None
        new_logprobs = [logprobs(token_id)] if logprobs else None
        outs.append(EngineOutput("r", [SequenceDelta(0, [token_id], new_logprobs, reason, stop_reason)], last,
                                 RequestMetrics(0.0)))
    return outs


def run_processor(tokenizer, params, outs, kind):
    processor = OutputProcessor(tokenizer)
    processor.add("r", "prompt", [1, 2, 3], params, kind)
    return [o for eo in outs for o in processor.process([eo])]


def top3(token_id):
    return {17: (-1.5, 2), 28: (-2.0, 3), token_id: (-0.5, 1)}  # the chosen token's entry wins a clash


def test_delta_outputs_add_up_to_the_final_output(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS))
    params = SamplingParams(logprobs=2)
    final = run_processor(tokenizer, params, engine_outputs(ids, top3), RequestOutputKind.FINAL_ONLY)
    deltas = run_processor(tokenizer, params, engine_outputs(ids, top3), RequestOutputKind.DELTA)
    cumulative = run_processor(tokenizer, params, engine_outputs(ids, top3), RequestOutputKind.CUMULATIVE)
    assert len(final) == 1 and final[0].finished
    want = final[0].outputs[0]
    assert want.text == tokenizer.decode(ids) and want.token_ids == ids
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == want.text
    assert [t for d in deltas for c in d.outputs for t in c.token_ids] == ids
    assert [lp for d in deltas for c in d.outputs for lp in c.logprobs] == want.logprobs
    assert deltas[-1].outputs[0].finish_reason == "length" and deltas[-1].finished
    assert cumulative[-1].outputs[0] == want
    assert [len(c.outputs[0].token_ids) for c in cumulative] == list(range(1, len(ids) + 1))
    assert want.logprobs[0][17].decoded_token == tokenizer.decode([17])
    assert want.cumulative_logprob == pytest.approx(-0.5 * len(ids))


def test_streamed_text_holds_back_what_could_become_a_stop_string_and_cuts_at_it(tokenizer):
    text = "one, two, three, four, five"
    ids = tokenizer.encode(text)
    # the engine ends the sequence at the token that completes " four"
    end = next(i for i in range(len(ids)) if " four" in tokenizer.decode(ids[:i + 1]))
    params = SamplingParams(stop=[" four"])
    deltas = run_processor(tokenizer, params, engine_outputs(ids[:end + 1], stop_at=" four"),
                           RequestOutputKind.DELTA)
    streamed = [c.text for d in deltas for c in d.outputs]
    assert "".join(streamed) == "one, two, three,"
    assert not any("four" in t or t.endswith(" fo") for t in streamed)
    assert deltas[-1].outputs[0].stop_reason == " four"


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_decoding_work_grows_linearly_with_the_output_length(tokenizer, kind):
    ids = tokenizer.encode(" ".join(TEXTS * 8))
    params = SamplingParams(logprobs=2)
    work = {}
    for length in (len(ids) // 4, len(ids)):
        counting = CountingTokenizer(tokenizer)
        run_processor(counting, params, engine_outputs(ids[:length], top3), kind)
        work[length] = counting.num_decoded_tokens
    short, long = sorted(work)
    # four times the tokens: about four times the decoding (a quadratic cost would be sixteen times)
    assert work[long] <= 5 * work[short]
    assert work[long] <= 12 * long  # a few tokens decoded per output token, text and logprobs together


@pytest.fixture(scope="module")
def llm():
    # bf16 in the batch-invariant mode: a request run again (its prompt now a prefix-cache hit) gives the same bits,
    # logprobs included (docs/batch_invariance.md)
    return LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, kv_cache_memory_bytes=64 << 20)


def run_engine(engine, prompt, params, kind):
    engine.add_request("req", prompt, params, output_kind=kind)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=24, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=30, stop=[" 7", "9,"]),
    SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, stop=[","], ignore_eos=True),
], ids=["n2-logprobs", "stop-strings", "min-tokens"])
def test_the_engines_delta_outputs_rebuild_its_cumulative_and_final_ones(llm, params):
    engine = llm.engine
    prompt = "1, 2, 3, 4, 5,"
    (final,) = run_engine(engine, prompt, params, RequestOutputKind.FINAL_ONLY)
    cumulative = run_engine(engine, prompt, params, RequestOutputKind.CUMULATIVE)
    deltas = run_engine(engine, prompt, params, RequestOutputKind.DELTA)
    assert cumulative[-1].outputs == final.outputs
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs == final.outputs
    for want in final.outputs:
        mine = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert "".join(c.text for c in mine) == want.text
        assert [t for c in mine for t in c.token_ids] == want.token_ids
        assert mine[-1].finish_reason == want.finish_reason and mine[-1].stop_reason == want.stop_reason
        assert sum(c.finish_reason is not None for c in mine) == 1  # a sequence's finish is reported once
        if want.logprobs is not None:
            assert [lp for c in mine for lp in c.logprobs] == want.logprobs
    if params.prompt_logprobs is not None:
        assert [d.prompt_logprobs is not None for d in deltas].count(True) == 1
        assert next(d.prompt_logprobs for d in deltas if d.prompt_logprobs) == final.prompt_logprobs
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.num_blocks



def test_a_sequence_with_stop_strings_is_detokenized_once_with_the_text_of_one_without(llm, monkeypatch):
    engine = llm.engine
    prompt = "1, 2, 3, 4, 5,"
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (want,) = run_engine(engine, prompt, plain, RequestOutputKind.FINAL_ONLY)
    output_side = CountingTokenizer(engine.output_processor.tokenizer)
    monkeypatch.setattr(engine.output_processor, "tokenizer", output_side)
    never_hit = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["never in this text"])
    for kind in RequestOutputKind:
        outputs = run_engine(engine, prompt, never_hit, kind)
        text = "".join(o.outputs[0].text for o in outputs) if kind is RequestOutputKind.DELTA \
            else outputs[-1].outputs[0].text
        # the last token (which ended the sequence by its length) is in the text too
        assert text == want.outputs[0].text and outputs[-1].outputs[0].finish_reason == "length"
    cut = want.outputs[0].text.index(" 7")
    (hit,) = run_engine(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=[" 7"]),
                        RequestOutputKind.FINAL_ONLY)
    assert hit.outputs[0].text == want.outputs[0].text[:cut] and hit.outputs[0].stop_reason == " 7"
    assert output_side.num_decoded_tokens == 0  # the engine's text, found stop strings in, is the one shown
