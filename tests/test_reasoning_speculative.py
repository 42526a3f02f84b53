"""Speculative decoding across the end of the thinking, through a real server (uvicorn on 127.0.0.1, the official
openai client) with --reasoning-parser qwen3: a tiny random Llama that can think, driven by a logit bias on
``</think>`` to close its greedy thinking at a known step. With n-gram drafts and with a draft model of the same
weights (whose greedy drafts, bias applied, are the target's own tokens, so a verified run of drafts carries
``</think>`` and the answer after it in one step), the answer must be plain greedy decoding's: the same
``reasoning_content``, the same ``content`` and the same token count, whole and streamed."""

from __future__ import annotations

import openai
import pytest

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from reasoning_models import closing_bias, write_tiny_thinker

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
OPTIONS = dict(dtype="float32", cpu_threads=1, max_model_len=256, kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_thinker(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="module")
def bias(model_dir):
    """``logit_bias`` closing the greedy thinking at a step k >= 2."""
    plain = LLM(model=str(model_dir), **OPTIONS).engine
    tokenizer = plain.tokenizer
    end = tokenizer.convert_tokens_to_ids("</think>")
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    value, _ = closing_bias(model_dir, tokenizer.encode(prompt, add_special_tokens=False), end)
    return {str(end): value}


def _ask(model_dir, bias, speculative_config=None):
    """(whole answer, streamed answer, the engine's speculation stats) from a server of its own."""
    engine = LLM(model=str(model_dir), speculative_config=speculative_config, **OPTIONS).engine
    srv = ServerThread(build_app(AsyncLLMEngine(engine), reasoning_parser="qwen3")).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        fields = dict(model=client.models.list().data[0].id, messages=MESSAGES, temperature=0, max_tokens=40,
                      logit_bias=bias)
        whole = client.chat.completions.create(**fields)
        message = whole.choices[0].message
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**fields, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
        return ((getattr(message, "reasoning_content", None), message.content, whole.usage.completion_tokens),
                (reasoning, content), engine.spec_stats)
    finally:
        srv.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(model_dir, bias):
    whole, streamed, _ = _ask(model_dir, bias)
    reasoning, content, _ = whole
    assert reasoning and content and "</think>" not in reasoning  # the thinking ended at the first </think>
    assert streamed == (reasoning, content)
    return whole


@pytest.mark.parametrize("spec", ["ngram", "same-weights draft"])
def test_speculation_across_the_end_of_the_thinking_splits_and_answers_as_plain_greedy(model_dir, bias, plain,
                                                                                        spec):
    config = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    if spec != "ngram":
        config = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4}
    whole, streamed, stats = _ask(model_dir, bias, config)
    assert whole == plain
    assert streamed == plain[:2]
    assert stats.num_accepted_tokens > 0  # drafts were verified and kept, not all refused
    if spec != "ngram":  # drafts are the target's own greedy tokens, </think> included: nearly all kept
        assert stats.num_accepted_tokens >= stats.num_draft_tokens // 2
