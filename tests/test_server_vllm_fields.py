"""vLLM's request fields through a real server on 127.0.0.1 with the official openai client (``extra_body``), each
checked by its effect: bad words and allowed tokens change the greedy answer, truncation the prompt, request ids
the response id, token ids and ``token_id:`` names the response, template kwargs and continuation the prompt."""

from __future__ import annotations

import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.plugins.entrypoints.server import ServerThread, build_app

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", batch_invariant=True, cpu_threads=1, kv_cache_memory_bytes=64 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def client(llm):
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    srv.stop()


def test_bad_words_and_allowed_token_ids_change_the_greedy_answer_offline_and_served(llm, client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True})
    text = plain.choices[0].message.content
    word = text.split()[0]
    banned = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                            extra_body={"bad_words": [word]})
    assert not banned.choices[0].message.content.startswith(word)
    assert plain.model_extra["prompt_token_ids"] and plain.choices[0].model_extra["token_ids"]
    only = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     extra_body={"allowed_token_ids": [13, 28], "return_token_ids": True})
    assert set(only.choices[0].model_extra["token_ids"]) <= {13, 28}
    offline = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4,
                                                                       allowed_token_ids=[13, 28]))
    assert set(offline[0].outputs[0].token_ids) <= {13, 28} and only.choices[0].text == offline[0].outputs[0].text


def test_truncation_request_id_and_token_ids_in_the_response(client):
    resp = client.completions.create(model=MODEL, prompt="one two three four five six seven", max_tokens=2,
                                     temperature=0, logprobs=1,
                                     extra_body={"truncate_prompt_tokens": 3, "request_id": "abc-1",
                                                 "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert resp.id == "cmpl-abc-1"
    choice = resp.choices[0].model_dump()
    assert len(choice["prompt_token_ids"]) == 3 and resp.usage.prompt_tokens == 3
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_chat_template_kwargs_continue_final_message_and_echo(client):
    messages = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                      "echo": True, "return_prompt_text": True,
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.model_extra["prompt_text"].endswith("The capital of France is")
    assert resp.choices[0].message.content.startswith("The capital of France is ")


def test_response_format_on_completions_and_vllm_fields_on_responses(client):
    resp = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=20, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert resp.choices[0].text.lstrip().startswith("{")
    answer = client.responses.create(model=MODEL, input="Pick a colour.", max_output_tokens=5, temperature=0,
                                     extra_body={"top_k": 1, "request_id": "resp_mine",
                                                 "structured_outputs": {"choice": ["red", "blue"]},
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert answer.id == "resp_mine" and answer.output_text in ("red", "blue")
