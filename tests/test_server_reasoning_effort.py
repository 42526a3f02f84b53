"""Reasoning effort as an OpenAI client sends it (``reasoning_effort`` on chat completions, ``reasoning.effort`` on
the Responses API), through a real server on 127.0.0.1 and the openai client, into the rendered prompt.

Tiny checkpoints with dummy weights (these tests look at prompts and status codes, not at answers): a gpt-oss
whose template carries the system-message lines of gpt-oss's own template (``Reasoning: <effort>``, medium when
none is sent), a Qwen3 with its thinking switch, and a ChatML template that reads no effort.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
import transformers

from pagoda import LLM
from pagoda.cli import main
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.serving import IGNORED_FIELDS_HEADER

# gpt-oss's template: its system message as the checkpoint's template writes it (the effort line, medium by
# default), then the harmony turns
HARMONY_TEMPLATE = """\
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: {{ strftime_now("%Y-%m-%d") }}

{% if reasoning_effort is not defined %}{% set reasoning_effort = "medium" %}{% endif -%}
Reasoning: {{ reasoning_effort }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
{%- for message in messages -%}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{% endif -%}"""
QWEN3_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
BASE = dict(hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512)
USER = [{"role": "user", "content": "What is 17 * 23?"}]
MODEL = "tiny"


def _config(family: str, vocab: int):
    if family == "gpt_oss":
        return transformers.GptOssConfig(vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                         architectures=["GptOssForCausalLM"], **BASE)
    return transformers.Qwen3Config(vocab_size=vocab, architectures=["Qwen3ForCausalLM"], **BASE)


@pytest.fixture(scope="module", params=["gpt_oss", "qwen3", "chatml"])
def served(request, tmp_path_factory):
    """(family, server, tokenizer) over a tiny checkpoint with dummy weights and the family's template."""
    family = request.param
    default = ensure_default_model()
    out = tmp_path_factory.mktemp(f"effort-{family}")
    tokenizer_config = json.loads((default / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = {"gpt_oss": HARMONY_TEMPLATE, "qwen3": QWEN3_TEMPLATE,
                                         "chatml": CHATML_TEMPLATE}[family]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(default / "tokenizer.json", out / "tokenizer.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    _config(family, len(tokenizer)).save_pretrained(str(out))
    # the torch path for gpt-oss's experts: no expert kernel to build for prompts
    llm = LLM(model=str(out), load_format="dummy", dtype="float32", cpu_threads=1, max_model_len=512,
              kv_cache_memory_bytes=8 << 20, fused_cpu_ops=False, served_model_name=MODEL)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    yield family, srv, tokenizer, llm
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(server, **fields):
    """(rendered prompt, its token ids, the raw response) of a one-token chat completion."""
    raw = _client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, max_tokens=1, temperature=0, **fields,
        extra_body={"return_prompt_text": True, "return_token_ids": True})
    body = json.loads(raw.text)
    return body["prompt_text"], body["prompt_token_ids"], raw


def test_the_effort_reaches_the_template_and_the_prompt_tokens(served):
    family, server, tokenizer, _ = served
    plain, plain_ids, raw = _chat(server)
    if family == "gpt_oss":
        assert "\nReasoning: medium\n" in plain  # the template's default
        for effort in ("low", "medium", "high"):
            text, ids, raw = _chat(server, reasoning_effort=effort)
            assert text == plain.replace("Reasoning: medium", f"Reasoning: {effort}")
            assert ids == tokenizer.encode(text, add_special_tokens=False)
            assert f"Reasoning: {effort}" in tokenizer.decode(ids)
            assert IGNORED_FIELDS_HEADER not in raw.headers
    elif family == "qwen3":  # no levels, a switch: none turns thinking off, any other effort leaves it on
        off, off_ids, raw = _chat(server, reasoning_effort="none")
        assert off == plain + "<think>\n\n</think>\n\n" and len(off_ids) > len(plain_ids)
        assert IGNORED_FIELDS_HEADER not in raw.headers
        assert _chat(server, reasoning_effort="low")[0] == plain
    else:  # a template that reads no effort: accepted, the same prompt, named as ignored
        text, ids, raw = _chat(server, reasoning_effort="high")
        assert (text, ids) == (plain, plain_ids)
        assert "reasoning_effort" in raw.headers[IGNORED_FIELDS_HEADER]


def test_chat_template_kwargs_win_over_the_field(served):
    family, server, _, _ = served
    if family != "qwen3":
        pytest.skip("the switch is Qwen3's")
    body = {"messages": USER, "max_tokens": 1, "return_prompt_text": True, "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": True}}
    text = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["prompt_text"]
    assert "<think>" not in text


def test_an_effort_the_model_does_not_know_is_a_400_naming_the_field(served):
    family, server, _, _ = served
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as bad:  # no schema's value
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, reasoning_effort="extreme")
    assert bad.value.body["param"] == "reasoning_effort"
    if family != "gpt_oss":
        return
    for effort in ("minimal", "none"):  # OpenAI's values that harmony has no level for
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, reasoning_effort=effort)
        assert bad.value.body["param"] == "reasoning_effort" and "'low', 'medium', 'high'" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, reasoning={"effort": "minimal"})
    assert bad.value.body["param"] == "reasoning.effort" and "gpt-oss" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"reasoning_effort": "max"}})
    assert bad.value.body["param"] == "chat_template_kwargs"


def test_the_responses_api_passes_reasoning_effort_to_the_template(served):
    family, server, tokenizer, _ = served
    client = _client(server)
    effort = {"gpt_oss": "high", "qwen3": "none", "chatml": "low"}[family]
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, reasoning={"effort": effort})
    assert answer.reasoning.effort == effort
    messages = [{"role": "user", "content": "Hi"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             reasoning_effort=effort, enable_thinking=effort != "none")
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert answer.usage.input_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    if family == "qwen3":  # thinking off: the empty think block is in the prompt
        assert answer.usage.input_tokens > len(tokenizer.encode(plain, add_special_tokens=False))
    raw = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "input": "Hi", "max_output_tokens": 1, "reasoning": {"effort": effort, "summary": "auto"}})
    # the summary is not written; with a template that reads no effort, the whole object does nothing
    assert raw.headers[IGNORED_FIELDS_HEADER] == ("reasoning" if family == "chatml" else "reasoning.summary")


def test_offline_chat_and_the_command_line_pass_the_effort_to_the_template(served):
    family, _, tokenizer, llm = served
    if family != "gpt_oss":
        pytest.skip("one family is enough offline")
    ids = llm.apply_chat_template(USER, chat_template_kwargs={"reasoning_effort": "high"})
    assert "Reasoning: high" in tokenizer.decode(ids)
    assert "Reasoning: medium" in tokenizer.decode(llm.apply_chat_template(USER))
    # the flag is the chat template's: refused, before any model is loaded, without --chat. The console script's
    # entry point in this process (test_cli.py starts the script itself): its SystemExit is the message the
    # interpreter prints, with exit status 1
    with pytest.raises(SystemExit, match="--reasoning-effort is read by the chat template: add --chat"):
        main(["generate", "hi", "--reasoning-effort", "low"])
