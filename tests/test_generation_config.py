"""A checkpoint's generation_config.json: every eos_token_id it lists ends a sequence, and its recommended sampling
settings are the defaults of requests that do not set them (``--generation-config``,
``--override-generation-config``), offline and through the server."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.generation_config import sampling_defaults
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from tiny_models import write_tiny_llama

PROMPT = "The capital of France is"
ENGINE = dict(cpu_threads=1, kv_cache_memory_bytes=8 << 20, max_model_len=128)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A tiny random Llama whose generation_config.json names one EOS and no sampling settings."""
    directory = write_tiny_llama(tmp_path_factory.mktemp("plain"), seed=3, chat_template=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return directory


@pytest.fixture(scope="module")
def greedy_tokens(plain_dir):
    """The tiny model's first greedy tokens after PROMPT, EOS ignored."""
    llm = LLM(model=str(plain_dir), **ENGINE)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    llm.engine.shutdown()
    return out.token_ids


def with_generation_config(source, target, config: dict):
    shutil.copytree(source, target)
    (target / "generation_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def recommending_dir(plain_dir, greedy_tokens, tmp_path_factory):
    """The same model, its generation_config.json listing a second EOS (the fourth greedy token, whichever of the
    first three it is not) and recommending sampling settings, as chat models' files do."""
    stop_at = next(i for i in range(3, 8) if greedy_tokens[i] not in greedy_tokens[:i])
    config = {"eos_token_id": [2, greedy_tokens[stop_at]], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
              "repetition_penalty": 1.05, "max_new_tokens": 6, "do_sample": True}
    directory = with_generation_config(plain_dir, tmp_path_factory.mktemp("recommending") / "model", config)
    return directory, stop_at


@pytest.fixture(scope="module")
def llm(recommending_dir):
    engine = LLM(model=str(recommending_dir[0]), **ENGINE)
    yield engine
    engine.engine.shutdown()


def test_every_listed_eos_ends_a_sequence_unless_eos_is_ignored_or_min_tokens_bans_it(llm, recommending_dir,
                                                                                      greedy_tokens):
    stop_at = recommending_dir[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate(PROMPT, greedy)[0].outputs[0]
    assert out.token_ids == greedy_tokens[:stop_at + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None  # an EOS, not a stop token id the request named
    ignoring = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert ignoring.token_ids == greedy_tokens and ignoring.finish_reason == "length"
    banned = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))[0].outputs[0]
    assert len(banned.token_ids) == 8 and greedy_tokens[stop_at] not in banned.token_ids[:8]
    assert llm.engine.eos_token_ids[:2] == [2, greedy_tokens[stop_at]]


def test_the_recommended_settings_are_the_defaults_and_values_transformers_writes_unasked_are_not(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) \
        == (0.6, 0.9, 20, 1.05, 6)
    # no SamplingParams: the model's, so at most max_new_tokens tokens
    assert len(llm.generate(PROMPT)[0].outputs[0].token_ids) <= 6
    assert sampling_defaults(llm.engine.config.model.model, "none", None) == {}


def test_generation_config_none_a_folder_and_overrides(recommending_dir, plain_dir, tmp_path):
    model_dir = recommending_dir[0]
    assert sampling_defaults(model_dir, "none", {"temperature": 0.3}) == {"temperature": 0.3}
    assert sampling_defaults(model_dir, "vllm", None) == {}
    assert sampling_defaults(plain_dir, str(model_dir), {"max_new_tokens": 3})["max_tokens"] == 3
    # transformers writes its own defaults into files (top_k 50, temperature 1): no recommendation
    unasked = with_generation_config(plain_dir, tmp_path / "unasked", {"top_k": 50, "temperature": 1.0, "top_p": 0.5})
    assert sampling_defaults(unasked, "auto", None) == {"top_p": 0.5}


@pytest.mark.parametrize("config, overrides, message", [
    ({"temperature": -1}, None, r"generation_config.json\) are invalid: .*temperature"),
    ({}, {"beams": 2}, r"--override-generation-config sets 'beams'; it takes temperature"),
    ("[1, 2]", None, r"holds a list, not a JSON object"),
])
def test_a_bad_generation_config_is_refused_at_start_naming_where(plain_dir, tmp_path, config, overrides, message):
    directory = shutil.copytree(plain_dir, tmp_path / "bad")
    (directory / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(directory), override_generation_config=overrides, **ENGINE)


def test_a_folder_that_is_not_one_is_refused(plain_dir, tmp_path):
    with pytest.raises(ConfigError, match="is neither auto, none nor a folder"):
        LLM(model=str(plain_dir), generation_config=str(tmp_path / "missing"), **ENGINE)


def test_served_requests_take_the_defaults_for_what_they_do_not_set(llm, recommending_dir, greedy_tokens):
    server = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = llm.engine.config.model.served_model_name
        # (a completions request without max_tokens asks for OpenAI's 16; a chat request leaves it unset)
        unset = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                               extra_body={"ignore_eos": True})
        assert unset.usage.completion_tokens == 6 and unset.choices[0].finish_reason == "length"  # max_new_tokens
        # the request's own settings win: greedy, 8 tokens, stopped by the second EOS
        own = client.completions.create(model=model, prompt=PROMPT, temperature=0.0, max_tokens=8)
        assert own.usage.completion_tokens == recommending_dir[1] + 1 and own.choices[0].finish_reason == "stop"
        # a seeded request that sets nothing samples as one that sets the recommended values itself
        messages = [{"role": "user", "content": "Tell me a story"}]
        chats = [client.chat.completions.create(model=model, messages=messages, seed=7, max_tokens=6, extra_body=extra)
                 for extra in ({"ignore_eos": True}, {"ignore_eos": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                      "repetition_penalty": 1.05})]
        greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0.0,
                                                extra_body={"ignore_eos": True})
        assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
        assert chats[0].choices[0].message.content != greedy.choices[0].message.content
        response = client.responses.create(model=model, input="Hi", max_output_tokens=4)
        assert (response.temperature, response.top_p) == (0.6, 0.9)
    finally:
        server.stop()
