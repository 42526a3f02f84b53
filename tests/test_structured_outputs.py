"""Structured outputs on the real default model, offline: every output matches its constraint.

Fifty JSON schemas of increasing difficulty (``structured_schemas.py``): each backend runs half of them here, in
one batched ``LLM.chat`` of greedy and sampled requests, and the other half under speculation in
``test_structured_outputs_speculative.py`` (``schema_share``); each output must end by the grammar (``stop``, never
``length``), parse, and validate with ``jsonschema``. Regexes, choices and grammars likewise.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from one_engine import release
from structured_schemas import MAX_TOKENS, SCHEMAS, prompt_for, schema_mismatches, schema_share, validator

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.engine.components import build_components
from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.modeling.default_model import ensure_default_model

BACKENDS = ["xgrammar", "guidance"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


# the default model in bf16, the batch-invariant mode making a request's greedy tokens the same bits whatever else
# ran in its steps (the rest of the batch, preemption; docs/batch_invariance.md)
BF16 = dict(dtype="bfloat16", batch_invariant=True, cpu_threads=1)


@pytest.fixture(scope="module")
def llm():
    ensure_default_model()
    llm = LLM(**BF16, kv_cache_memory_bytes=256 << 20)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm



def structured(temperature: float, max_tokens: int = 48, seed=None, n: int = 1, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=n,
                          structured_outputs=StructuredOutputsParams(**constraint))


# each backend runs the other half of the fifty under n-gram speculation in test_structured_outputs_speculative.py:
# every schema is validated under both backends, greedy and sampled, with and without speculation
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_output_of_fifty_json_schemas_parses_and_validates(llm, backend):
    share = schema_share(backend, speculative=False)
    conversations = [prompt_for(SCHEMAS[i][0]) for i, _ in share]
    params = [structured(temperature, MAX_TOKENS, seed=i, json=SCHEMAS[i][1], backend=backend)
              for i, temperature in share]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    failures = schema_mismatches(outputs, [i for i, _ in share])
    assert not failures, f"{len(failures)} of {len(share)} outputs do not match their schema:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_grammar_and_json_object_outputs_match(llm, backend):
    regex = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    choices = ["Paris", "London", "Rome"]
    grammar = 'root ::= "(" num (" " op " " num)+ ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    prompts = ["Today's date is", "The capital of France is", "An arithmetic expression:",
               "A JSON object describing a cat:", "Today's date is", "The capital of France is",
               "An arithmetic expression:"]
    # any JSON object has no end the schema forces: only greedy, whose object this model closes
    params = [structured(0.0, 40, regex=regex, backend=backend), structured(0.0, 40, choice=choices, backend=backend),
              structured(0.0, 40, grammar=grammar, backend=backend),
              structured(0.0, 80, json_object=True, backend=backend),
              structured(1.0, 40, seed=2, regex=regex, backend=backend),
              structured(1.0, 40, seed=3, choice=choices, backend=backend),
              structured(1.0, 40, seed=4, grammar=grammar, backend=backend)]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(c.finish_reason == "stop" for c in outputs), [(c.finish_reason, c.text) for c in outputs]
    for k in (0, 4):
        assert re.fullmatch(regex, outputs[k].text), outputs[k].text
    for k in (1, 5):
        assert outputs[k].text in choices
    for k in (2, 6):
        expression = outputs[k].text
        assert re.fullmatch(r"\([1-9][0-9]?( [-+*] [1-9][0-9]?)+\)", expression), expression
        assert isinstance(eval(expression, {"__builtins__": {}}), int)  # parses as the arithmetic it says
    assert isinstance(json.loads(outputs[3].text), dict), outputs[3].text


def test_a_lark_grammar_reaches_the_backend_that_reads_it(llm):
    lark = 'start: "yes" | "no" | "maybe"'
    out = llm.generate("Is the sky blue? Answer:", structured(0.0, 8, grammar=lark), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no", "maybe")


def test_each_of_n_sequences_follows_the_grammar_on_its_own(llm):
    out = llm.chat([{"role": "user", "content": "Describe a person as JSON."}],
                   structured(1.0, 60, seed=7, n=4, json=PERSON), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        validator(PERSON).validate(json.loads(c.text))


def test_max_tokens_still_ends_a_constrained_request_with_length(llm):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    out = llm.generate("Numbers:", structured(0.0, 6, json=schema), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith("[")


def test_the_grammar_allows_the_end_only_where_the_match_is_complete(llm):
    # the model would stop after a word or two; the regex wants exactly 12 lowercase letters
    out = llm.generate("Say hi:", structured(0.0, 30, regex="[a-z]{12}"), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[a-z]{12}", out.text), out.text


@pytest.mark.parametrize("choices, text", [(["yes", "no"], {"yes", "no"}), ([""], {""})])
def test_the_grammar_ends_the_output_where_min_tokens_would_ban_its_end(llm, choices, text):
    # min_tokens bans EOS for longer than any choice lasts: the grammar, the hard constraint, ends the output
    # (finish_reason stop), and the request is not failed for a token the mask could not allow
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate("Answer yes or no:", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in text, (out.finish_reason, out.text)


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["The capital of France is", "Pick one:"],
                         [plain, structured(0.0, 8, choice=["left", "right"])], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text in ("left", "right")


@pytest.mark.parametrize("constraint, field, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}},
     "structured_outputs.json", "'zero' is not of type 'number'"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"regex": "[0-9"}, "structured_outputs.regex", "regex"),
    ({"grammar": "root ::= ( \"a\""}, "structured_outputs.grammar", "grammar"),
])
def test_a_constraint_that_does_not_compile_is_an_invalid_request_naming_its_field(llm, constraint, field, words):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("x", structured(0.0, 4, **constraint), use_tqdm=False)
    assert info.value.param == field
    assert field in str(info.value) and words in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_an_unknown_backend_is_refused_with_the_known_ones(llm):
    with pytest.raises(InvalidRequestError, match="unknown structured-output backend 'outlines'.*xgrammar") as info:
        llm.generate("x", structured(0.0, 4, regex="a", backend="outlines"), use_tqdm=False)
    assert info.value.param == "structured_outputs.backend"
    config = dataclasses.replace(llm.engine.config, structured_outputs_backend="outlines")
    with pytest.raises(ConfigError, match="unknown structured-output backend 'outlines' for "
                                          "structured_outputs_backend; known: auto, guidance, llguidance, xgrammar"):
        build_components(config, llm.engine.pm)  # before any weight is read


def test_auto_sends_a_schema_xgrammar_cannot_honour_to_guidance(llm):
    email = {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 16}},
             "required": ["email"], "additionalProperties": False}
    assert "ignores its maxLength" in llm.engine.structured_outputs._backend("xgrammar").supports(
        StructuredOutputsParams(json=email))
    params = structured(1.0, 40, seed=0, json=email)
    assert llm.engine.structured_outputs.compiled(params.structured_outputs).backend_name == "guidance"
    out = llm.chat([{"role": "user", "content": "My email address as JSON."}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    validator(email).validate(json.loads(out.text))


def test_a_compiled_constraint_is_cached_per_backend_and_constraint(llm):
    so = llm.engine.structured_outputs
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"zzz": {"type": "boolean"}}})
    assert not so.is_cached(spec)
    first = so.compiled(spec)
    same = StructuredOutputsParams(json=json.dumps({"properties": {"zzz": {"type": "boolean"}}, "type": "object"}))
    assert so.is_cached(same) and so.compiled(same) is first
    other = StructuredOutputsParams(json=spec.json, backend="guidance")
    assert not so.is_cached(other) and so.compiled(other).backend_name == "guidance"


def test_a_step_retried_after_a_fault_advances_no_matcher_twice(llm):
    from test_step_faults import Fault

    params = structured(0.0, 60, json=PERSON)
    conversation = [{"role": "user", "content": "Describe a person as JSON."}]
    clean = llm.chat([conversation] * 2, params, use_tqdm=False)
    fault = Fault(llm, lambda step, ids: step == 4 and fault.raised == 0)
    try:
        faulty = llm.chat([conversation] * 2, params, use_tqdm=False)
    finally:
        fault.remove(llm)
    assert fault.raised == 1
    assert [o.outputs[0].token_ids for o in faulty] == [o.outputs[0].token_ids for o in clean]
    assert all(o.outputs[0].finish_reason == "stop" for o in faulty)


def test_requests_preempted_by_recompute_resume_in_their_grammar(llm):
    regex = "[a-z]{5}( [a-z]{5}){3}"
    prompts = [f"Write four words, number {i}:" for i in range(3)]
    params = structured(0.0, 40, regex=regex)
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # 4 blocks, 64 tokens, for 3 requests of about 30 tokens each
    tight = LLM(**BF16, max_model_len=256, num_gpu_blocks_override=4)
    try:
        outs = tight.generate(prompts, params, use_tqdm=False)
        num_preemptions = tight.engine.scheduler.num_preemptions
    finally:
        release(tight)
        del tight
    assert num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == roomy
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)


def test_xgrammar_keeps_raw_control_characters_out_of_length_bounded_strings():
    """xgrammar writes a string with minLength / maxLength as characters other than a quote, a backslash, CR and
    LF, so a raw tab or U+0017 got through (a random model's greedy answer held one) and json.loads refused the
    answer; pagoda gives such a string a pattern of as many characters, none a control character."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from pagoda.sampling.structured.xgrammar_backend import XgrammarBackend

    raw = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 5}},
           "required": ["city"]}
    method, (schema_text,), kwargs = XgrammarBackend._call_of(StructuredOutputsParams(json=raw))
    assert method == "compile_json_schema"
    before = xgrammar.Grammar.from_json_schema(json.dumps(raw), **kwargs)
    after = xgrammar.Grammar.from_json_schema(schema_text, **kwargs)
    for city, valid in (("abc", True), ("ab\tc", False), ("a\x17", False), ("\u00e9\u4e16", True), ("a", False),
                        ("abcdef", False)):
        text = '{"city": "%s"}' % city.encode().decode("unicode_escape")
        assert _is_grammar_accept_string(after, text) == valid, city
        if city in ("ab\tc", "a\x17"):
            assert _is_grammar_accept_string(before, text)  # what xgrammar alone let through
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)


def test_xgrammar_holds_a_date_format_to_days_that_exist():
    """xgrammar's own "date" format lets 2023-02-30 through; pagoda gives it a pattern of real calendar dates."""
    import datetime

    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from pagoda.sampling.structured.xgrammar_backend import XgrammarBackend

    schema = XgrammarBackend._with_calendar_dates({"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}}, "required": ["day"]})
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    for day in ["2024-02-29", "2000-02-29", "0004-02-29", "2023-12-31", "0001-01-01", "2023-02-30", "6012-02-30",
                "1900-02-29", "2023-04-31", "0000-01-01", "2023-13-01", "2023-00-10"]:
        try:
            datetime.date.fromisoformat(day)
            exists = True
        except ValueError:
            exists = False
        assert _is_grammar_accept_string(grammar, json.dumps({"day": day})) == exists, day
