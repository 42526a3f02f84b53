"""Structured outputs after the thinking, in the engine: a tiny random Llama that can think (``<think>`` and
``</think>`` single ids), driven to close its thinking by a logit bias on ``</think>`` chosen from transformers'
own logits, so that the thinking is the model's unconstrained greedy text and ends at a known step. The
constraint must hold the answer only, and the answer's tokens must be those of a run whose prompt holds the
thinking and whose constraint starts from its first token (float32: exact)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from one_engine import release
from pagoda import LLM
from pagoda.sampling.structured.after_reasoning import AfterReasoning
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from reasoning_models import closing_bias, write_tiny_thinker

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Who are you?"}]
OPTIONS = dict(dtype="float32", cpu_threads=1, max_model_len=256, kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_thinker(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model=str(model_dir), **OPTIONS)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm


@pytest.fixture(scope="module")
def drive(model_dir, llm):
    """(prompt ids, ``</think>``'s id, the bias that closes the greedy thinking at a step k >= 2, that thinking)."""
    tokenizer = llm.get_tokenizer()
    end = tokenizer.convert_tokens_to_ids("</think>")
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    bias, thinking = closing_bias(model_dir, prompt, end)
    return prompt, end, bias, thinking


def constrained(reasoning_parser=None, **fields):
    return StructuredOutputsParams(json=SCHEMA, reasoning_parser=reasoning_parser, **fields)


def test_the_schema_holds_the_answer_after_the_thinking_and_matches_a_run_constrained_from_the_thinkings_end(
        llm, drive):
    prompt, end, bias, thinking = drive
    params = SamplingParams(temperature=0, max_tokens=80, logit_bias={end: bias},
                            structured_outputs=constrained("qwen3"))
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    # the thinking is the model's own greedy text, unconstrained (the schema would have begun with "{")
    assert ids[:len(thinking)] == thinking and ids[len(thinking)] == end
    assert not llm.get_tokenizer().decode(thinking).lstrip().startswith("{")
    answer = ids[len(thinking) + 1:]
    text = llm.get_tokenizer().decode(answer, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.finish_reason == "stop"
    # the reference: the thinking in the prompt, the constraint from the first token
    reference = SamplingParams(temperature=0, max_tokens=80, logit_bias={end: bias}, structured_outputs=constrained())
    ref = llm.generate({"prompt_token_ids": prompt + thinking + [end]}, reference, use_tqdm=False)[0].outputs[0]
    assert list(ref.token_ids) == answer


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_every_backend_starts_its_grammar_where_the_thinking_ends(llm, drive, backend):
    prompt, end, bias, thinking = drive
    params = SamplingParams(temperature=0, max_tokens=80, logit_bias={end: bias},
                            structured_outputs=constrained("deepseek_r1", backend=backend))
    ids = list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert ids[:len(thinking) + 1] == thinking + [end]
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(ids[len(thinking) + 1:], skip_special_tokens=True)), SCHEMA)


def test_with_thinking_switched_off_the_schema_holds_the_answer_from_its_first_token(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=False)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constrained("qwen3"))
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    plain = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constrained())
    assert list(llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids) == list(out.token_ids)


def test_a_model_that_never_ends_its_thinking_is_never_constrained(llm, drive):
    prompt = drive[0]
    free = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=constrained("deepseek_r1"))
    held = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert list(held.token_ids) == list(free.token_ids) and held.finish_reason == "length"


def test_an_unknown_reasoning_parser_is_refused_by_name(llm):
    from pagoda.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="nonesuch"):
        llm.generate("hi", SamplingParams(structured_outputs=constrained("nonesuch")), use_tqdm=False)


@pytest.mark.parametrize("spec", [{"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                   "num_speculative_tokens": 3}], ids=["ngram"])
def test_speculative_decoding_gives_the_same_tokens_drafts_unconstrained_while_thinking(model_dir, llm, drive, spec):
    prompt, end, bias, thinking = drive
    params = SamplingParams(temperature=0, max_tokens=80, logit_bias={end: bias},
                            structured_outputs=constrained("deepseek_r1"))
    plain = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    speculative = LLM(model=str(model_dir), speculative_config=spec, **OPTIONS)
    try:
        out = speculative.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    finally:
        speculative.engine.shutdown() if hasattr(speculative.engine, "shutdown") else None
    assert list(out.token_ids) == list(plain.token_ids)


def test_the_matcher_waits_accepts_the_thinking_and_rolls_back_across_its_end(llm):
    tokenizer = llm.get_tokenizer()
    grammar = llm.engine.structured_outputs.compiled(constrained())
    from pagoda.plugins.entrypoints.reasoning_parsers import BUILT_IN_REASONING_PARSERS

    parser = BUILT_IN_REASONING_PARSERS["deepseek_r1"]("")
    matcher = AfterReasoning(grammar.new_matcher(), lambda ids: parser.reasoning_end(ids, tokenizer))
    thinking = tokenizer.encode("not json at all", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("</think>")
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert all(matcher.accept_tokens([t]) for t in thinking) and matcher.is_waiting
    assert not matcher.may_end() and not matcher.is_terminated()
    assert matcher.accept_tokens([end]) and not matcher.is_waiting
    assert not matcher.accept_tokens(thinking[:1])  # the answer is held: "not" is no JSON
    assert matcher.accept_tokens(brace)
    matcher.rollback(2)  # "{" and "</think>": thinking again
    assert matcher.is_waiting and matcher.accept_tokens(thinking[:1])
