"""The engine with the real default model: batching invariance, stop conditions, outputs, bad input.

One engine is shared by the whole module (loading costs seconds): bf16 in the batch-invariant mode, so a request's
greedy tokens are the same bits alone, in any batch and prefilled in any chunks (docs/batch_invariance.md). Its step
budget is small so that long prompts are prefilled in chunks while other requests decode.
"""

from __future__ import annotations

import gc
import random

import pytest

from pagoda import LLM, ConfigError, InvalidRequestError, SamplingParams
from pagoda.modeling.default_model import ensure_default_model
from one_engine import release
from tiny_models import write_tiny_checkpoint

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves:",
    "import numpy as np\n\ndef softmax(x):",
    "Three reasons to learn a second language are",
    " ".join(f"Line {i}: the lighthouse keeper counted {i * 11 % 17} ships." for i in range(1, 25))
    + " The total number of ships was",
    "Hello",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    ensure_default_model()
    llm = LLM(dtype="bfloat16", batch_invariant=True, max_model_len=1024, max_num_batched_tokens=96, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20, cpu_threads=1)
    yield llm
    release(llm)  # nothing the module built stays in the worker
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt generated alone with GREEDY: ``{prompt: its completion}``."""
    return {p: llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS}


@pytest.fixture(scope="module")
def one_at_a_time(alone):
    """The token ids of each prompt generated alone: the reference every batched run must reproduce."""
    return {p: completion.token_ids for p, completion in alone.items()}


def run_engine_until_done(engine, pending: set[str]) -> dict[str, list[int]]:
    done = {}
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
                done[out.request_id] = out.outputs[0].token_ids
    return done


def assert_engine_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.num_blocks


# ---- batching --------------------------------------------------------------------------------


def test_batched_generation_equals_one_at_a_time(llm, one_at_a_time):
    llm.engine.kv_manager.reset_prefix_cache()  # prefill the batch for real, not from the cache
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [one_at_a_time[p] for p in PROMPTS]
    assert_engine_idle(llm)


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_generation_is_independent_of_arrival_order(llm, one_at_a_time, seed):
    order = PROMPTS[:]
    random.Random(seed).shuffle(order)
    if seed == 0:
        llm.engine.kv_manager.reset_prefix_cache()
    outputs = llm.generate(order, GREEDY, use_tqdm=False)
    for prompt, out in zip(order, outputs):
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == one_at_a_time[prompt]


def test_requests_added_while_others_run_get_the_same_tokens(llm, one_at_a_time):
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()
    order = PROMPTS[::-1]
    pending, done = set(), {}
    for i, prompt in enumerate(order):
        rid = engine.add_request(f"staggered-{i}", prompt, GREEDY)
        pending.add(rid)
        # let the running requests advance a different number of steps before the next arrival
        for _ in range(i % 3 + 1):
            for out in engine.step():
                if out.finished:
                    pending.discard(out.request_id)
                    done[out.request_id] = out.outputs[0].token_ids
    done.update(run_engine_until_done(engine, pending))
    for i, prompt in enumerate(order):
        assert done[f"staggered-{i}"] == one_at_a_time[prompt], prompt[:30]
    assert_engine_idle(llm)


def test_streamed_outputs_grow_one_token_per_step_and_finish_once(llm):
    engine = llm.engine
    engine.add_request("stream", "Count: one, two,", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    lengths, finished = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
            finished += out.finished
    assert lengths == [1, 2, 3, 4, 5, 6]
    assert finished == 1


# ---- n > 1 -------------------------------------------------------------------------------------


def test_n_greedy_sequences_are_all_the_greedy_answer(llm, one_at_a_time):
    prompt = PROMPTS[0]
    out = llm.generate(prompt, GREEDY.clone(n=3), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == one_at_a_time[prompt] for c in out.outputs)
    assert_engine_idle(llm)


def test_n_sampled_sequences_differ_and_reproduce_with_a_seed(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    # two requests with the same seed in one batch: each request's samples come from its own seed alone
    first, again = llm.generate(["My favourite animal is"] * 2, params, use_tqdm=False)
    seqs = [tuple(c.token_ids) for c in first.outputs]
    assert len(seqs) == 4 and all(len(s) == 10 for s in seqs)
    assert len(set(seqs)) > 1  # independent samples, not one sample copied
    assert seqs == [tuple(c.token_ids) for c in again.outputs]


# ---- stop conditions -------------------------------------------------------------------------


def test_max_tokens_finishes_with_reason_length(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


SAY_HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def say_hello(llm):
    """The model's own chat answer to SAY_HELLO, which ends with EOS, and the runs whose lengths depend on it, in
    two batches (a request's tokens do not depend on its batch: test_batched_generation_equals_one_at_a_time):
    ``natural`` (special tokens skipped in the text), ``kept`` (not skipped), ``forced`` (ignore_eos, 8 tokens
    past the answer) and ``held`` (min_tokens 5 past the answer, with room for 3 more: it ends with ``forced``)."""
    natural, kept = (out.outputs[0] for out in llm.chat(
        [SAY_HELLO, SAY_HELLO], [SamplingParams(temperature=0.0, max_tokens=64),
                                 SamplingParams(temperature=0.0, max_tokens=64, skip_special_tokens=False)],
        use_tqdm=False))
    num_natural = len(natural.token_ids)
    forced, held = (out.outputs[0] for out in llm.chat(
        [SAY_HELLO, SAY_HELLO], [SamplingParams(temperature=0.0, max_tokens=num_natural + 8, ignore_eos=True),
                                 SamplingParams(temperature=0.0, max_tokens=num_natural + 5 + 3,
                                                min_tokens=num_natural + 5)],
        use_tqdm=False))
    return {"natural": natural, "kept": kept, "forced": forced, "held": held}


def test_eos_stops_a_chat_answer_and_ignore_eos_runs_to_max_tokens(llm, say_hello):
    eos = llm.engine.eos_token_id
    natural, forced = say_hello["natural"], say_hello["forced"]
    assert natural.finish_reason == "stop"
    assert natural.token_ids[-1] == eos and eos not in natural.token_ids[:-1]
    assert "<|im_end|>" not in natural.text  # special tokens are skipped in the text
    assert forced.finish_reason == "length"
    assert len(forced.token_ids) == len(natural.token_ids) + 8
    assert forced.token_ids[:len(natural.token_ids)] == natural.token_ids


def test_min_tokens_holds_back_eos(llm, say_hello):
    eos = llm.engine.eos_token_id
    natural, held = say_hello["natural"], say_hello["held"]
    min_tokens = len(natural.token_ids) + 5
    assert len(held.token_ids) >= min_tokens
    assert eos not in held.token_ids[:min_tokens]
    assert held.token_ids[:len(natural.token_ids) - 1] == natural.token_ids[:-1]


def test_stop_string_truncates_the_text_and_is_reported(llm, alone):
    prompt = PROMPTS[0]
    full = alone[prompt]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    out, kept = (o.outputs[0] for o in llm.generate(
        [prompt, prompt], [GREEDY.clone(stop=["@@never@@", stop]),
                           GREEDY.clone(stop=stop, include_stop_str_in_output=True)], use_tqdm=False))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full.text[:cut]
    assert len(out.token_ids) < len(full.token_ids)
    assert kept.text == full.text[:cut + len(stop)]


def test_stop_token_ids_end_the_sequence_at_that_token(llm, one_at_a_time):
    prompt = PROMPTS[3]
    reference = one_at_a_time[prompt]
    stop_id = reference[4]
    first = reference.index(stop_id)
    out = llm.generate(prompt, GREEDY.clone(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[:first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id


# ---- logprobs ----------------------------------------------------------------------------------


def test_logprobs_hold_the_sampled_token_and_the_top_k(llm):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=4)
    out = llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry
        assert len(entry) in (4, 5)  # the top 4, plus the sampled token when it is not among them
        top = sorted((lp for lp in entry.values() if lp.rank <= 4), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3, 4]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprobs_zero_returns_only_the_sampled_token(llm):
    out = llm.generate(PROMPTS[0], GREEDY.clone(logprobs=0), use_tqdm=False)[0].outputs[0]
    assert all(list(entry) == [t] and entry[t].rank == 1 for t, entry in zip(out.token_ids, out.logprobs))


def assert_complete_prompt_logprobs(out, num_top: int) -> None:
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for token_id, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        assert token_id in entry and len(entry) in (num_top, num_top + 1)


def test_prompt_logprobs_cover_every_prompt_token_even_when_chunked(llm):
    # longer than the 96-token step budget, so prefilled in chunks; never seen before, so not cached
    prompt = " ".join(f"Row {i}: a gardener planted {i * 5 % 9} tulips." for i in range(1, 20))
    out = llm.generate(prompt, GREEDY.clone(prompt_logprobs=2, max_tokens=2), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 96
    assert_complete_prompt_logprobs(out, 2)
    assert out.outputs[0].logprobs is None  # not asked for


def test_prompt_logprobs_are_complete_when_the_prompt_is_in_the_prefix_cache(llm, one_at_a_time):
    prompt = PROMPTS[4]  # cached by the one-at-a-time reference run
    out = llm.generate(prompt, GREEDY.clone(prompt_logprobs=2, max_tokens=2), use_tqdm=False)[0]
    assert_complete_prompt_logprobs(out, 2)


def test_max_tokens_zero_only_prefills_and_scores_the_prompt_as_a_generating_request_does(llm):
    # longer than the 96-token step budget: prefilled in chunks, as an evaluation harness's long contexts are
    prompt = " ".join(f"Row {i}: a baker sold {i * 7 % 11} loaves." for i in range(1, 20))
    scored = llm.generate(prompt, GREEDY.clone(prompt_logprobs=3, max_tokens=0, logprobs=1), use_tqdm=False)[0]
    generated = llm.generate(prompt, GREEDY.clone(prompt_logprobs=3, max_tokens=1), use_tqdm=False)[0]
    out = scored.outputs[0]
    assert len(scored.prompt_token_ids) > 96
    assert out.token_ids == [] and out.text == "" and out.logprobs == [] and out.finish_reason == "length"
    assert_complete_prompt_logprobs(scored, 3)
    for got, want in zip(scored.prompt_logprobs[1:], generated.prompt_logprobs[1:]):
        assert {t: lp.logprob for t, lp in got.items()} == pytest.approx({t: lp.logprob for t, lp in want.items()})
    assert scored.metrics.first_token_time is None  # no token was generated
    assert_engine_idle(llm)  # its blocks were freed when its prompt was computed


def test_max_tokens_zero_requests_finish_beside_generating_ones_without_changing_them(llm, one_at_a_time):
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"gen-{i}", p, GREEDY)
        engine.add_request(f"score-{i}", p, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for i, p in enumerate(PROMPTS):
        assert finished[f"gen-{i}"].outputs[0].token_ids == one_at_a_time[p]
        scored = finished[f"score-{i}"]
        assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
        assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    assert_engine_idle(llm)


# ---- chat ----------------------------------------------------------------------------------------


def test_chat_applies_the_template_and_accepts_several_conversations(llm):
    conversations = [
        [{"role": "user", "content": "What colour is the sky?"}],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Good morning!"}],
    ]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert len(outputs) == 2
    for conv, out in zip(conversations, outputs):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert tok.decode(out.prompt_token_ids).endswith("assistant\n")
        assert out.outputs[0].text.strip()


# ---- bad input -----------------------------------------------------------------------------------


def test_unknown_scheduling_policy_lists_the_available_ones():
    with pytest.raises(ConfigError) as info:
        LLM(scheduling_policy="nope", dtype="float32")
    msg = str(info.value)
    assert "'nope'" in msg and "scheduling_policy" in msg
    assert "'fcfs'" in msg and "'priority'" in msg and "pagoda (built-in)" in msg


def test_unknown_engine_option_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="max_num_seq"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("options, named", [
    (dict(max_model_len=100_000), "max_model_len 100000 exceeds the model's 8192 positions"),
    (dict(dtype="float64"), "dtype 'float64' is not supported"),
    (dict(block_size=12), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
])
def test_bad_engine_options_are_config_errors_naming_them(options, named):
    with pytest.raises(ConfigError, match=named):
        LLM(**options)


def test_prompts_can_be_text_token_ids_or_dicts(llm, one_at_a_time):
    tok = llm.get_tokenizer()
    prompt = PROMPTS[0]
    ids = tok.encode(prompt)
    outputs = llm.generate([prompt, {"prompt": prompt}, {"prompt_token_ids": ids}, ids], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids == one_at_a_time[prompt] for o in outputs)
    assert [o.prompt for o in outputs] == [prompt, prompt, None, None]
    assert all(o.prompt_token_ids == ids for o in outputs)


def test_model_directory_without_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        LLM(model=str(tmp_path))
    assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not a local directory"):
        LLM(model=str(tmp_path / "nowhere"))


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 1.5), ("n", 0),
    ("max_tokens", -1), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", -2),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logit_bias", {5: 500.0}),
    # wrong types are named too, never a bare TypeError
    ("temperature", None), ("temperature", float("nan")), ("top_p", "0.9"), ("max_tokens", 2.5), ("n", True),
    ("top_k", 1.5), ("stop", 5), ("logprobs", 2.0),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_bad_requests_are_rejected_and_the_engine_keeps_working(llm, one_at_a_time):
    tok = llm.get_tokenizer()
    too_long = {"prompt_token_ids": [tok.encode("word")[0]] * 1024}
    with pytest.raises(InvalidRequestError, match="maximum context length is 1024 tokens, but the prompt has 1024"):
        llm.generate(too_long, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 10 ** 6]}, GREEDY, use_tqdm=False)
    # more logprobs than the engine's --max-logprobs (20 by default)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        llm.generate(PROMPTS[0], GREEDY.clone(logprobs=100), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [GREEDY, GREEDY], use_tqdm=False)
    # a bad prompt in the middle of a list leaves nothing of the list behind
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPTS[0], too_long, PROMPTS[1]], GREEDY, use_tqdm=False)
    assert_engine_idle(llm)
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [one_at_a_time[p] for p in PROMPTS[:2]]


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", "Hello", GREEDY)
    try:
        with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
            engine.add_request("dup", "Hello again", GREEDY)
    finally:
        engine.abort_request("dup")
    engine.step()  # the abort is reported once, then nothing is left
    assert_engine_idle(llm)


# ---- more edges ------------------------------------------------------------------------------------


def test_a_seeded_sampled_request_is_the_same_alone_and_in_a_crowd(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]
    others = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    outputs = llm.generate(crowd, [others, params, others], use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == alone


def test_text_is_the_detokenized_token_ids(llm):
    tok = llm.get_tokenizer()
    prompts = [PROMPTS[0], PROMPTS[2], "Traduis en japonais : bonjour, le café est prêt →", "Emoji story: 🐉"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        # a character whose bytes are cut off by max_tokens is held back, never shown as U+FFFD
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_aborting_a_running_request_frees_it_and_leaves_the_others_unchanged(llm, one_at_a_time):
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", prompt, GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort_request("abort-1")
    done = run_engine_until_done(engine, {"abort-0", "abort-2"})
    assert done == {"abort-0": one_at_a_time[PROMPTS[0]], "abort-2": one_at_a_time[PROMPTS[2]]}
    assert_engine_idle(llm)


def test_stop_strings_do_not_fire_before_min_tokens(llm, alone):
    prompt = PROMPTS[0]
    full = alone[prompt]
    stop = full.text.split()[0]  # appears in the very first tokens
    out = llm.generate(prompt, GREEDY.clone(stop=stop, min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids  # the early occurrence is let through; none comes later
    assert out.finish_reason == "length" and out.text == full.text


def test_n_sequences_each_carry_logprobs_and_share_the_prompt_logprobs(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    prompt = "A fresh prompt about penguins on the ice shelf"
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert len(completion.logprobs) == 4
        assert all(t in entry for t, entry in zip(completion.token_ids, completion.logprobs))
    assert_complete_prompt_logprobs(out, 1)


# ---- a tiny random-weight engine for limits that need other engine options -------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A one-layer Llama config with the default model's tokenizer (no chat template); dummy weights."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), chat_template=False)


@pytest.fixture(scope="module")
def short_context(tiny_dir):
    """A tiny engine with a 64-token context whose prompts are prefilled in chunks of 16: the end of the context
    is a matter of counts, which this engine reaches in a few milliseconds a step."""
    llm = LLM(model=str(tiny_dir), load_format="dummy", dtype="float32", max_model_len=64, max_num_batched_tokens=16,
              max_num_seqs=4, kv_cache_memory_bytes=1 << 20, cpu_threads=1)
    yield llm
    release(llm)
    del llm


def test_a_prompt_one_token_short_of_max_model_len_generates_exactly_one_token(short_context):
    ids = [(7 * i) % 1000 + 3 for i in range(63)]
    out = short_context.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=50,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"


def test_max_tokens_none_generates_until_the_context_is_full(short_context):
    ids = [(5 * i) % 1000 + 3 for i in range(50)]
    out = short_context.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=None,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64 - 50
    assert out.outputs[0].finish_reason == "length"


def test_a_prompt_larger_than_the_whole_kv_cache_is_rejected_up_front(tiny_dir):
    # 1 layer * 2 (K, V) * 16 tokens * 1 head * 16 dims * 4 bytes = 2 KiB per block; 8 blocks hold 128 tokens
    llm = LLM(model=str(tiny_dir), load_format="dummy", dtype="float32", kv_cache_memory_bytes=8 * 2048,
              attention_backend="torch", cpu_threads=1)
    assert llm.engine.num_blocks == 8
    with pytest.raises(InvalidRequestError, match="needs 10 KV blocks but the cache holds 8"):
        llm.generate({"prompt_token_ids": [7] * 150}, GREEDY, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [7] * 100}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_chat_without_a_chat_template_says_how_to_provide_one(tiny_dir):
    llm = LLM(model=str(tiny_dir), load_format="dummy", kv_cache_memory_bytes=1 << 20, cpu_threads=1)
    with pytest.raises(InvalidRequestError, match="no chat template; pass chat_template="):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}<|im_start|>"
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template=template)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "<|im_start|>hi<|im_end|><|im_start|>"


def test_streamed_text_only_grows_and_never_shows_what_a_stop_string_cuts(llm, alone):
    prompt = PROMPTS[0]
    full = alone[prompt].text
    stop = full[full.index("answer"):full.index("answer") + 9]  # a stop string spanning several tokens
    engine = llm.engine
    engine.add_request("streamed-stop", prompt, GREEDY.clone(stop=stop))
    texts = []
    while engine.has_unfinished_requests():
        texts.extend(out.outputs[0].text for out in engine.step())
    final = texts[-1]
    assert final == full[:full.index(stop)]
    assert all(final.startswith(t) for t in texts)
    assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:]))


def test_special_tokens_appear_in_the_text_when_not_skipped(say_hello):
    kept = say_hello["kept"]
    assert kept.token_ids == say_hello["natural"].token_ids
    assert kept.text.endswith("<|im_end|>")


def test_a_request_id_that_collides_with_another_requests_sequence_id_is_refused(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, n=2)
    engine.add_request("pair", "Hello", params)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("pair-0", "Hello", SamplingParams(max_tokens=2))
    engine.abort_request("pair")
    engine.add_request("pair-0", "Hello", SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
