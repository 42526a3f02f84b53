"""``LLM.beam_search`` (vLLM's offline beam search) against transformers' beam search on a tiny random Llama in
float32: the same beams in the same order with the same scores."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_llama

from pagoda import LLM, BeamSearchParams
from pagoda.errors import InvalidRequestError

PROMPT = [5, 17, 301, 42, 9, 1200, 77]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("beam"), seed=3, norm_noise=0.5)


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", cpu_threads=1, kv_cache_memory_bytes=8 << 20)
    yield llm
    llm.shutdown()


def test_the_beams_are_transformers_beams_in_its_order_with_its_scores(model_dir, llm):
    import transformers

    width, steps = 3, 5
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    eos = llm.engine.eos_token_id
    ref = hf.generate(torch.tensor([PROMPT]), num_beams=width, num_return_sequences=width, max_new_tokens=steps,
                      min_new_tokens=steps, do_sample=False, length_penalty=0.0, early_stopping=True,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=eos, eos_token_id=eos)
    (out,) = llm.beam_search([{"prompt_token_ids": PROMPT}],
                             BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, length_penalty=0.0))
    theirs = [seq[len(PROMPT):].tolist() for seq in ref.sequences]
    ours = [beam.tokens[len(PROMPT):] for beam in out.sequences]
    assert all(eos not in t for t in theirs + ours)  # (the comparison holds only while no beam meets an EOS)
    assert ours == theirs
    assert [b.cum_logprob for b in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
    # each beam's score is the sum of its chosen tokens' logprobs, and every step offered 2 x width candidates
    for beam in out.sequences:
        chosen = [step[token].logprob for step, token in zip(beam.logprobs, beam.tokens[len(PROMPT):])]
        assert sum(chosen) == pytest.approx(beam.cum_logprob, abs=1e-5)
        assert all(len(step) >= 2 * width for step in beam.logprobs)
        assert beam.finish_reason == "length" and beam.text == llm.get_tokenizer().decode(beam.tokens)


def test_text_prompts_and_several_at_once_give_what_each_gives_alone(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    both = llm.beam_search(["The capital of France is", "Hello"], params)
    alone = [llm.beam_search(p, params)[0] for p in ("The capital of France is", "Hello")]
    assert [[b.tokens for b in o.sequences] for o in both] == [[b.tokens for b in o.sequences] for o in alone]
    assert all(len(o.sequences) == 2 for o in both)


def test_a_beam_width_past_the_logprobs_limit_is_refused_saying_what_to_use(llm):
    with pytest.raises(InvalidRequestError, match=r"beam_width=11 needs 22 logprobs per step, more than this "
                                                  r"engine's max_logprobs \(20\); use beam_width <= 10"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="beam_width=0: give a whole number >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)


def test_a_completion_with_use_beam_search_answers_the_offline_beams_as_its_n_choices(model_dir):
    """vLLM's use_beam_search on /v1/completions through the official openai client: n is the beam width."""
    import openai

    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.plugins.entrypoints.server import ServerThread, build_app

    llm = LLM(model=str(model_dir), dtype="float32", cpu_threads=1, kv_cache_memory_bytes=8 << 20,
              disable_log_stats=False)
    (offline,) = llm.beam_search([{"prompt_token_ids": PROMPT}],
                                 BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5))
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=5, extra_body={
            "use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5, "return_token_ids": True})
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert [c.model_extra["token_ids"] for c in answer.choices] == [b.tokens[len(PROMPT):]
                                                                        for b in offline.sequences]
        assert [c.text for c in answer.choices] == [llm.get_tokenizer().decode(b.tokens[len(PROMPT):])
                                                    for b in offline.sequences]
        assert answer.usage.completion_tokens == 15 and answer.usage.prompt_tokens == len(PROMPT)
        with pytest.raises(openai.BadRequestError, match="use_beam_search does not take stream"):
            client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=2, stream=True,
                                      extra_body={"use_beam_search": True})
        with pytest.raises(openai.BadRequestError, match=r"n=11 needs 22 logprobs per step, more than this "
                                                         r"engine's --max-logprobs \(20\); use n <= 10"):
            client.completions.create(model=model, prompt=PROMPT, n=11, max_tokens=2,
                                      extra_body={"use_beam_search": True})
        # every beam's one-token request ended: nothing left running, waiting or holding blocks
        import httpx

        page = httpx.get(srv.url + "/metrics", timeout=30).text
        for name in ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc"):
            (line,) = [l for l in page.splitlines() if l.startswith(name + "{") or l.startswith(name + " ")]
            assert float(line.rsplit(" ", 1)[1]) == 0, line
    finally:
        srv.stop()
        llm.shutdown()


def test_a_chat_with_use_beam_search_answers_the_rendered_prompt_s_beams(tmp_path):
    import openai

    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.plugins.entrypoints.server import ServerThread, build_app

    llm = LLM(model=str(write_tiny_llama(tmp_path, seed=5, norm_noise=0.5, chat_template=True)), dtype="float32",
              cpu_threads=1, kv_cache_memory_bytes=8 << 20)
    messages = [{"role": "user", "content": "Name a river."}]
    (offline,) = llm.beam_search([{"prompt_token_ids": llm.apply_chat_template(messages)}],
                                 BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4,
                                                extra_body={"use_beam_search": True, "ignore_eos": True})
        tok = llm.get_tokenizer()
        assert [c.message.content for c in answer.choices] == [tok.decode(b.tokens[len(b.tokens) - 4:])
                                                               for b in offline.sequences]
        assert [c.finish_reason for c in answer.choices] == ["length", "length"]
        with pytest.raises(openai.BadRequestError, match="use_beam_search does not take stream"):
            client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=2, stream=True,
                                           extra_body={"use_beam_search": True})
    finally:
        srv.stop()
        llm.shutdown()
