"""Structured outputs with speculative decoding, on the real default model: the grammar masks every scored
position of a verified run (``pagoda.sampling.structured.speculative``), a draft the grammar forbids is
rejected, greedy tokens are those of decoding without speculation, and the matchers stand at the committed
tokens through preemption and a retried step. A draft model drafts inside the grammar (a fork of each matcher),
which raises its acceptance; a matcher that cannot fork leaves its drafts unsteered."""

from __future__ import annotations

import json
import re

import pytest
import torch
from one_engine import OneEngine
from structured_schemas import MAX_TOKENS, SCHEMAS, prompt_for, schema_mismatches, schema_share, validator

from pagoda import LLM, SamplingParams, StructuredOutputsParams, hookimpl
from pagoda.engine.generation_config import eos_token_ids
from pagoda.modeling.default_model import ensure_default_model
from pagoda.sampling.structured.bitmask import allocate_bitmask, allowed_tokens
from pagoda.sampling.structured.speculative import DraftGrammars, fill_draft_rows

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft_model", "model": "self:layers=8", "num_speculative_tokens": 3}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
CITIES = ["Paris", "London", "Rome"]
# the prompt repeats itself, so n-gram lookup drafts its words; the regex allows digits only
REPEATING = "Repeat after me: red green blue red green blue red green blue red green blue"
DIGITS = "[0-9]{16}"


# the default model in bf16, the batch-invariant mode making a request's greedy tokens the same bits whatever else
# ran in its steps (a verified run of drafts, the rest of the batch, preemption; docs/batch_invariance.md)
BF16 = dict(dtype="bfloat16", batch_invariant=True, cpu_threads=1)


def llm_with(spec=None, **kwargs) -> LLM:
    ensure_default_model()
    return LLM(**BF16, kv_cache_memory_bytes=256 << 20, speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def engines():
    """One engine alive at a time (each holds a copy of the default model): the tests below are ordered by the
    engine they use, and the last is released at the module's end."""
    engines = OneEngine({
        "plain": llm_with,
        "ngram": lambda: llm_with(NGRAM),
        "self_draft": lambda: llm_with(SELF_DRAFT),
        # the target as its own checkpoint draft: the own-cache path, whose first draft comes from the catch-up pass
        "checkpoint_draft": lambda: llm_with({"method": "draft_model", "model": str(ensure_default_model()),
                                              "num_speculative_tokens": 3}),
        # four blocks: the requests preempt each other
        "tight": lambda: LLM(**BF16, max_model_len=256, num_gpu_blocks_override=4, speculative_config=NGRAM),
    })
    yield engines
    engines.close()


@pytest.fixture
def ngram(engines):
    return engines.get("ngram")


@pytest.fixture
def self_draft(engines):
    return engines.get("self_draft")



def structured(temperature: float, max_tokens: int = 48, seed=None, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_counters_consistent(llm: LLM) -> None:
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    # a position is accepted only after every earlier one was
    per_pos = stats.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= stats.num_drafts
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.has_unfinished_requests()


# ---- the draft rows of one matcher -------------------------------------------------------------------------


@pytest.fixture
def tokenizer_and_backends(engines):
    """The tokenizer, end token, vocabulary size and backends of the engine without speculation (the first the
    end-to-end tests below use): built once for the module, with nothing of their own to release."""
    engine = engines.get("plain").engine
    tokenizer = engine.tokenizer
    eos = eos_token_ids(engine.config.model.model, tokenizer)[0]
    backends = {}
    for name in ("xgrammar", "guidance"):
        engine.structured_outputs.compiled(StructuredOutputsParams(regex="a", backend=name))  # builds the backend
        backends[name] = engine.structured_outputs._backend(name)
    return tokenizer, eos, engine.config.model.vocab_size, backends


def rows_of(matcher, vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_tokens(bitmask, vocab)[0]


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_each_draft_row_holds_the_tokens_allowed_after_the_drafts_before_it(tokenizer_and_backends, backend):
    tokenizer, eos, vocab, backends = tokenizer_and_backends
    compiled = backends[backend].compile(StructuredOutputsParams(json=PERSON))
    matcher, reference = backends[backend].new_matcher(compiled), backends[backend].new_matcher(compiled)
    committed = tokenizer.encode('{"name": "Ann', add_special_tokens=False)
    drafts = tokenizer.encode('", "age": 4', add_special_tokens=False) + [eos]
    assert matcher.accept_tokens(committed) and reference.accept_tokens(committed)
    before = rows_of(matcher, vocab)
    bitmask = allocate_bitmask(len(drafts) + 1, vocab)
    assert fill_draft_rows(matcher, drafts, bitmask, 0) == len(drafts) - 1  # the end is refused mid-object
    got = allowed_tokens(bitmask, vocab)
    assert got[0].all()  # row 0 is the caller's
    for j, token_id in enumerate(drafts[:-1]):
        assert reference.accept_tokens([token_id])
        assert torch.equal(got[j + 1], rows_of(reference, vocab)), f"row {j + 1}"
    assert not got[len(drafts) - 1][eos]  # so the target gives the refused end probability 0
    assert torch.equal(rows_of(matcher, vocab), before)  # rolled back to the committed tokens
    assert matcher.accept_tokens(drafts[:-1]) and not matcher.may_end()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_refused_draft_ends_the_rows_and_the_end_of_the_grammar_rolls_back_too(tokenizer_and_backends, backend):
    tokenizer, eos, vocab, backends = tokenizer_and_backends
    compiled = backends[backend].compile(StructuredOutputsParams(regex="[0-9]{3}"))
    matcher = backends[backend].new_matcher(compiled)
    start = rows_of(matcher, vocab)
    # "1", "2", then a letter the regex refuses: rows 1 and 2 filled, row 3 left as it was
    drafts = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "12a"]
    bitmask = torch.zeros((4, allocate_bitmask(1, vocab).shape[1]), dtype=torch.int32)
    assert fill_draft_rows(matcher, drafts, bitmask, 0) == 2
    rows = allowed_tokens(bitmask, vocab)
    assert rows[1].any() and rows[2].any() and not rows[3].any() and not rows[2][drafts[2]]
    assert torch.equal(rows_of(matcher, vocab), start)
    # a whole match and its end: accepted, then rolled back with the rest
    drafts = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "123"] + [eos]
    # (guidance's matcher counts as terminated once only the end may follow: it stops before the end)
    assert fill_draft_rows(matcher, drafts, allocate_bitmask(5, vocab), 0) in (3, 4)
    assert torch.equal(rows_of(matcher, vocab), start) and not matcher.is_terminated()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_draft_grammars_mask_each_position_with_a_fork_and_leave_the_matcher_alone(tokenizer_and_backends, backend):
    tokenizer, eos, vocab, backends = tokenizer_and_backends
    compiled = backends[backend].compile(StructuredOutputsParams(json=PERSON))
    matcher, reference = backends[backend].new_matcher(compiled), backends[backend].new_matcher(compiled)
    committed = tokenizer.encode('{"name": "Ann', add_special_tokens=False)
    assert matcher.accept_tokens(committed) and reference.accept_tokens(committed)
    before = rows_of(matcher, vocab)
    grammars = DraftGrammars([None, matcher], vocab)  # row 0 has no grammar
    logits = torch.zeros(2, vocab)
    grammars.mask_(logits, [0, 1])
    assert (logits[0] == 0).all() and torch.equal(logits[1] == 0, before) and (logits[1] == float("-inf")).any()
    for token_id in tokenizer.encode('", "age": 4', add_special_tokens=False):
        assert grammars.accept(1, token_id) and reference.accept_tokens([token_id])
        logits = torch.zeros(1, vocab)
        grammars.mask_(logits, [1])
        assert torch.equal(logits[0] == 0, rows_of(reference, vocab))
    assert not grammars.accept(1, tokenizer.encode("x", add_special_tokens=False)[0])  # refused: no more drafts
    assert torch.equal(rows_of(matcher, vocab), before)  # the sequence's matcher never moved


# ---- end to end ---------------------------------------------------------------------------------------------


# greedy decoding under a grammar: ten of the fifty schemas; and a regex, a choice and a digits-only regex, greedy
# then sampled, in one batch whose greedy rows must be those of decoding without speculation
GREEDY_CONVERSATIONS = [prompt_for(description) for description, _ in SCHEMAS[::5]]
OTHER_PROMPTS = ["Today's date is", "The capital of France is", REPEATING] * 2


def greedy_params() -> list[SamplingParams]:
    return [structured(0.0, MAX_TOKENS, json=schema) for _, schema in SCHEMAS[::5]]


def other_params() -> list[SamplingParams]:
    return [structured(0.0, 40, regex=DATE), structured(0.0, 8, choice=CITIES), structured(0.0, 20, regex=DIGITS),
            structured(1.0, 40, seed=2, regex=DATE, backend="guidance"),
            structured(1.0, 8, seed=3, choice=CITIES, backend="guidance"),
            structured(1.0, 20, seed=4, regex=DIGITS)]


PREEMPTED_REGEX = "[a-z]{5}( [a-z]{5}){3}"
PREEMPTED_PROMPTS = [f"Write four words, number {i}: abcde abcde abcde" for i in range(3)]


@pytest.fixture(scope="module")
def plain_greedy_tokens(engines) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The tokens of decoding without speculation, computed once with one engine for every test that compares
    with them (greedy: they do not depend on what ran before): the schemas, the greedy rows of the other
    constraints' batch, and the requests that the preemption test runs with too few blocks."""
    plain = engines.get("plain")
    return (token_ids(plain.chat(GREEDY_CONVERSATIONS, greedy_params(), use_tqdm=False)),
            token_ids(plain.generate(OTHER_PROMPTS, other_params(), use_tqdm=False))[:3],
            token_ids(plain.generate(PREEMPTED_PROMPTS, structured(0.0, 40, regex=PREEMPTED_REGEX),
                                     use_tqdm=False)))


def test_greedy_tokens_under_a_grammar_are_those_of_decoding_without_speculation(plain_greedy_tokens, ngram):
    # with a self-draft: test_steered_drafts_give_the_greedy_tokens_and_more_of_them_are_accepted; the regex and
    # choice rows: test_regex_and_choice_outputs_match_in_full_with_speculation
    assert token_ids(ngram.chat(GREEDY_CONVERSATIONS, greedy_params(), use_tqdm=False)) == plain_greedy_tokens[0]
    assert ngram.engine.spec_stats.num_accepted_tokens > 0
    assert_counters_consistent(ngram)


# ---- drafts steered by the grammar -------------------------------------------------------------------------


class MatcherWithoutFork:
    """A matcher as a backend written for plugin API 1.7 makes it: every member but ``fork``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def fill_bitmask(self, bitmask, row) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def accept_tokens(self, token_ids) -> bool:
        return self.inner.accept_tokens(token_ids)

    def rollback(self, num_tokens) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def may_end(self) -> bool:
        return self.inner.may_end()


class BackendWithoutFork:
    """xgrammar's grammars behind matchers that cannot fork, registered as ``xgrammar-1.7``: its requests' drafts
    are proposed unsteered, as before plugin API 1.8."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def supports(self, spec):
        return self.inner.supports(spec)

    def compile(self, spec):
        return self.inner.compile(spec)

    def new_matcher(self, compiled) -> MatcherWithoutFork:
        return MatcherWithoutFork(self.inner.new_matcher(compiled))


class UnforkedXgrammarPlugin:
    @hookimpl
    def pagoda_structured_output_backends(self, plugin_manager):
        def factory(model_config, tokenizer, eos_token_ids):
            xgrammar = plugin_manager.factory("pagoda_structured_output_backends", "xgrammar")
            return BackendWithoutFork(xgrammar(model_config, tokenizer, eos_token_ids))

        return {"xgrammar-1.7": factory}


def test_steered_drafts_give_the_greedy_tokens_and_more_of_them_are_accepted(self_draft, plain_greedy_tokens):
    """Greedy decoding under a grammar with a self-draft gives the tokens of decoding without speculation, whether
    its drafts are steered by the grammar (xgrammar, whose matchers fork) or not; the steered ones are accepted
    more often."""
    if "xgrammar-1.7" not in self_draft.engine.pm.names("pagoda_structured_output_backends"):
        self_draft.engine.pm.register(UnforkedXgrammarPlugin(), name="unforked-xgrammar")
    stats = self_draft.engine.spec_stats

    # the first five of the ten schemas the n-gram test runs, the simpler ones with the shorter outputs (the fifty
    # grow in difficulty): a batch takes as many steps as its longest output, here on the slowest proposer (8 of 30
    # layers per draft token), twice
    def run(backend: str) -> tuple[list[list[int]], int, int]:
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        params = [structured(0.0, MAX_TOKENS, json=schema, backend=backend) for _, schema in SCHEMAS[:25:5]]
        outputs = self_draft.chat(GREEDY_CONVERSATIONS[:5], params, use_tqdm=False)
        return token_ids(outputs), stats.num_accepted_tokens - accepted, stats.num_draft_tokens - drafted

    steered_tokens, steered_accepted, steered_drafted = run("xgrammar")
    unsteered_tokens, unsteered_accepted, unsteered_drafted = run("xgrammar-1.7")
    assert steered_tokens == plain_greedy_tokens[0][:5], "steered drafts"
    assert unsteered_tokens == plain_greedy_tokens[0][:5], "unsteered drafts"
    steered_rate, unsteered_rate = steered_accepted / steered_drafted, unsteered_accepted / unsteered_drafted
    print(f"steered drafts: {steered_accepted} of {steered_drafted} accepted; unsteered: {unsteered_accepted} of "
          f"{unsteered_drafted}")
    # the first 8 of 30 layers guess the target's next token badly, but a schema's keys, quotes and braces
    # leave the grammar one choice, which only a steered draft takes
    assert steered_rate > 2 * unsteered_rate, (steered_accepted, steered_drafted, unsteered_accepted,
                                               unsteered_drafted)
    assert_counters_consistent(self_draft)


@pytest.mark.parametrize("proposer", ["self_draft", "ngram"])  # the engine of the test before first
def test_regex_and_choice_outputs_match_in_full_with_speculation(proposer, request, plain_greedy_tokens):
    llm = request.getfixturevalue(proposer)
    outputs = [o.outputs[0] for o in llm.generate(OTHER_PROMPTS, other_params(), use_tqdm=False)]
    assert [list(c.token_ids) for c in outputs[:3]] == plain_greedy_tokens[1], "the greedy rows"
    assert all(c.finish_reason == "stop" for c in outputs), [(c.finish_reason, c.text) for c in outputs]
    for k, pattern in ((0, DATE), (2, DIGITS), (3, DATE), (5, DIGITS)):
        assert re.fullmatch(pattern, outputs[k].text), outputs[k].text
    assert outputs[1].text in CITIES and outputs[4].text in CITIES
    assert_counters_consistent(llm)


# each backend runs the other half of the fifty without speculation in test_structured_outputs.py
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_every_output_of_fifty_json_schemas_validates_with_ngram_speculation(ngram, backend):
    share = schema_share(backend, speculative=True)
    conversations = [prompt_for(SCHEMAS[i][0]) for i, _ in share]
    params = [structured(temperature, MAX_TOKENS, seed=i, json=SCHEMAS[i][1], backend=backend)
              for i, temperature in share]
    drafts_before = ngram.engine.spec_stats.num_draft_tokens
    outputs = ngram.chat(conversations, params, use_tqdm=False)
    failures = schema_mismatches(outputs, [i for i, _ in share])
    assert not failures, f"{len(failures)} of {len(share)} outputs do not match their schema:\n" + "\n".join(failures)
    assert ngram.engine.spec_stats.num_draft_tokens > drafts_before  # the drafts were verified under the grammar
    assert_counters_consistent(ngram)


class DraftLog:
    """Wraps the engine's own proposer; per step, each request's drafts and the run the step committed
    (the accepted drafts, then the target's token)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.proposer = self.runner.proposer
        self.runner.proposer = self
        llm.engine.observers.append(self)
        self.steps: list[list[tuple[list[int], list[int]]]] = []
        self._drafts: list[list[int]] = []

    def remove(self, llm: LLM) -> None:
        self.runner.proposer = self.proposer
        llm.engine.observers.remove(self)

    def propose(self, sched):
        drafts, probs = self.proposer.propose(sched)
        self._drafts = drafts
        return drafts, probs

    def before_step(self, engine, sched) -> None:
        self._drafts = []

    def after_step(self, engine, sched, result, seconds) -> None:
        if result is not None:
            self.steps.append([(list(d), list(t)) for d, t in zip(self._drafts or [[]] * len(sched.requests),
                                                                   result.sampled_token_ids)])


def test_drafts_the_grammar_forbids_are_rejected_and_the_output_stays_valid(ngram):
    # the grammar takes the prompt's first words, then digits: n-gram lookup drafts the words that follow in
    # the prompt, and the grammar forbids them once the words are done
    regex = " red green blue [0-9]{8}"
    llm = ngram
    stats = llm.engine.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    log = DraftLog(llm)
    vocab = llm.engine.config.model.vocab_size
    try:
        replay_forbidden_drafts(llm, log, regex, vocab)
    finally:
        log.remove(llm)
    assert 0 < stats.num_accepted_tokens - accepted < stats.num_draft_tokens - drafted
    assert_counters_consistent(llm)


def replay_forbidden_drafts(llm: LLM, log: DraftLog, regex: str, vocab: int) -> None:
    for temperature in (0.0, 1.0):
        log.steps.clear()
        out = llm.generate([REPEATING], structured(temperature, 24, seed=5, regex=regex), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(regex, out.outputs[0].text), out.outputs[0]
        # replay the steps on a matcher of the same grammar: the first draft it refuses must not be accepted
        matcher = llm.engine.structured_outputs.compiled(StructuredOutputsParams(regex=regex)).new_matcher()
        num_forbidden_runs = 0
        for (drafts, committed), in log.steps:
            num_valid = fill_draft_rows(matcher, drafts, allocate_bitmask(len(drafts) + 1, vocab), 0)
            if num_valid < len(drafts):
                num_forbidden_runs += 1
                assert len(committed) - 1 <= num_valid, (drafts, committed)
            for token_id in committed:
                if not matcher.is_terminated():
                    assert matcher.accept_tokens([token_id]), (drafts, committed)
        assert num_forbidden_runs > 0, "the n-gram proposer drafted no token the grammar forbids"


def test_a_step_retried_after_a_fault_leaves_the_matchers_at_the_committed_tokens(ngram):
    from test_step_faults import Fault

    params = structured(0.0, 60, json=PERSON)
    conversation = [{"role": "user", "content": "Describe a person as JSON, named Ann Ann Ann."}]
    clean = ngram.chat([conversation] * 2, params, use_tqdm=False)
    fault = Fault(ngram, lambda step, ids: step == 4 and fault.raised == 0)
    try:
        faulty = ngram.chat([conversation] * 2, params, use_tqdm=False)
    finally:
        fault.remove(ngram)
    assert fault.raised == 1
    assert token_ids(faulty) == token_ids(clean)
    assert all(o.outputs[0].finish_reason == "stop" for o in faulty)


def test_requests_preempted_by_recompute_resume_in_their_grammar_with_speculation(engines, plain_greedy_tokens):
    roomy = plain_greedy_tokens[2]  # the same requests with room for all, without speculation
    tight = engines.get("tight")
    outs = tight.generate(PREEMPTED_PROMPTS, structured(0.0, 40, regex=PREEMPTED_REGEX), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == roomy
    assert all(re.fullmatch(PREEMPTED_REGEX, o.outputs[0].text) for o in outs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_draft_of_a_checkpoint_draft_fits_the_grammar(engines, temperature):
    # the target as its own checkpoint draft: the own-cache path, whose first draft comes from the catch-up pass
    llm = engines.get("checkpoint_draft")
    stats = llm.engine.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    log = DraftLog(llm)
    vocab = llm.engine.config.model.vocab_size
    conversation = [{"role": "user", "content": "Describe a person as JSON."}]
    try:
        out = llm.chat([conversation], structured(temperature, 60, seed=7, json=PERSON), use_tqdm=False)[0].outputs[0]
    finally:
        log.remove(llm)
    assert out.finish_reason == "stop" and schema_mismatches_of(out.text, PERSON) == []
    matcher = llm.engine.structured_outputs.compiled(StructuredOutputsParams(json=PERSON)).new_matcher()
    num_drafts = 0
    for (drafts, committed), in log.steps:
        assert fill_draft_rows(matcher, drafts, allocate_bitmask(len(drafts) + 1, vocab), 0) == len(drafts), drafts
        num_drafts += len(drafts)
        for token_id in committed:
            if not matcher.is_terminated():
                assert matcher.accept_tokens([token_id])
    assert num_drafts > 0
    if temperature == 0.0:  # the same model drafting inside the same grammar: its greedy drafts are the target's
        accepted, drafted = stats.num_accepted_tokens - accepted, stats.num_draft_tokens - drafted
        assert accepted >= 0.9 * drafted, (accepted, drafted)
    assert_counters_consistent(llm)


def schema_mismatches_of(text: str, schema: dict) -> list[str]:
    return [error.message for error in validator(schema).iter_errors(json.loads(text))]
