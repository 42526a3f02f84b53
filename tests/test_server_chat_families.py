"""Chat templates and tool calls of the model families through the server: the family table
(pagoda.plugins.entrypoints.server.tool_families) on its own, gpt-oss's harmony template included, and tiny
Qwen3, Gemma 2 and Gemma 3 checkpoints served on 127.0.0.1.

Each checkpoint is a config.json that transformers writes from the architecture's own config class, the default
model's tokenizer, and a chat template in its tokenizer_config.json written in the family's format (the parts
that matter here: Qwen3's thinking switch and ``<tool_call>`` format, Gemma 3 folding a system message into the
first user turn, Gemma 2 refusing one, gpt-oss's harmony turns). Weights are dummy: these tests look at prompts,
status codes and headers, not at the answers' words.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import transformers

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app
from pagoda.plugins.entrypoints.server.tool_families import detect_tool_setup
from pagoda.plugins.entrypoints.server.tools import WARNING_HEADER
from pagoda.registry.plugin_manager import PluginManager

SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")
# Qwen3's format: ChatML, the tools in the system turn with <tool_call> instructions, and enable_thinking=false
# closing an empty think block after the generation prompt
QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
# Gemma 3's format: no system role; a system message's text opens the first user turn
GEMMA3_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = "" -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
<start_of_turn>{{ role }}
{{ (first_user_prefix if loop.first else "") + message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}"""
# Gemma 2's format: the same turns, and a system message refused by the template itself
GEMMA2_TEMPLATE = """\
{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
{%- for message in messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
<start_of_turn>{{ role }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}"""
# gpt-oss's harmony turns, without tools
HARMONY_TEMPLATE = """\
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.<|end|>
{%- for message in messages -%}
{%- if message.role == 'system' or message.role == 'developer' -%}<|start|>developer<|message|># Instructions

{{ message.content }}<|end|>
{%- else -%}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{% endif -%}"""
LLAMA31_TEMPLATE = ("{{- bos_token }}{%- if tools is not none %}Environment: ipython{% endif %}<|start_header_id|>"
                    "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}<|python_tag|>")
LLAMA30_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
                    "<|eot_id|>{% endfor %}")


# ---- the family table -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type, template, parser, shipped", [
    ("llama", SMOLLM2_TEMPLATE, "hermes", "chatml_hermes.jinja"),  # SmolLM2: ChatML without tools
    ("qwen3", QWEN3_TEMPLATE, "hermes", None),  # its own template shows tools
    ("qwen2", "", "hermes", None),  # no template at all: the parser still fits, nothing to replace
    ("llama", LLAMA31_TEMPLATE, "llama3_json", None),  # Llama 3.1+: JSON calls, tools in its template
    ("llama", LLAMA30_TEMPLATE, "llama3_json", "llama3_json.jinja"),  # Llama 3.0: the turns, no tools
    ("gemma3_text", GEMMA3_TEMPLATE, None, None),
    ("gemma2", GEMMA2_TEMPLATE, None, None),
    ("gpt_oss", HARMONY_TEMPLATE, "openai", None),  # harmony calls; its own template renders the tools
    ("olmo2", "no markers", None, None),
])
def test_the_family_table_picks_the_parser_and_a_template_only_where_the_checkpoints_cannot_show_tools(
        model_type, template, parser, shipped):
    setup = detect_tool_setup({"model_type": model_type, "architectures": ["X"]}, template)
    assert (setup.parser, setup.template_name) == (parser, shipped), setup.reason
    assert (setup.template is None) == (shipped is None)


def test_the_reasons_say_which_format_a_family_writes_when_pagoda_has_no_parser_for_it():
    assert "[TOOL_CALLS]" in detect_tool_setup({"model_type": "mistral"}, "").reason
    assert "pythonic" in detect_tool_setup({"model_type": "gemma3_text"}, GEMMA3_TEMPLATE).reason
    # a multimodal config's text model decides
    assert detect_tool_setup({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}},
                             GEMMA3_TEMPLATE).family == "Gemma 3"


def test_flags_override_the_family_and_a_given_template_is_never_replaced():
    named = detect_tool_setup({"model_type": "llama"}, SMOLLM2_TEMPLATE, parser="llama3_json")
    assert named.parser == "llama3_json" and named.template is None  # no shipped llama3 template for ChatML turns
    given = detect_tool_setup({"model_type": "llama"}, SMOLLM2_TEMPLATE, template_given=True)
    assert given.parser == "hermes" and given.template is None


def test_the_server_options_follow_the_table_and_the_off_switch(tmp_path):
    from pagoda.errors import ConfigError
    from pagoda.plugins.entrypoints.server.tools import ToolCallingOptions

    pm = PluginManager().load(autoload=False)
    smollm = ToolCallingOptions.resolve(pm, None, None, {"model_type": "llama"}, SMOLLM2_TEMPLATE)
    assert smollm.enable_auto_tool_choice and smollm.parser_name == "hermes" and smollm.tool_template
    assert smollm.template_for(None, [{"role": "user", "content": "Hi"}]) is None  # no tools: its own template
    assert smollm.template_for([{"type": "function"}], []) == smollm.tool_template
    assert smollm.template_for(None, [{"role": "tool", "content": "18"}]) == smollm.tool_template
    gemma = ToolCallingOptions.resolve(pm, None, None, {"model_type": "gemma3_text"}, GEMMA3_TEMPLATE)
    assert not gemma.enable_auto_tool_choice and "pythonic" in gemma.unread_reason
    with pytest.raises(ConfigError, match="no parser fits this Gemma 3 model"):
        ToolCallingOptions.resolve(pm, True, None, {"model_type": "gemma3_text"}, GEMMA3_TEMPLATE)
    with pytest.raises(ConfigError, match="vLLM's parser for Mistral's .TOOL_CALLS. lists is not in pagoda"):
        ToolCallingOptions.resolve(pm, None, "mistral", {"model_type": "mistral"}, "")
    gpt_oss = ToolCallingOptions.resolve(pm, None, None, {"model_type": "gpt_oss"}, HARMONY_TEMPLATE)
    assert gpt_oss.enable_auto_tool_choice and gpt_oss.parser_name == "openai"
    off = ToolCallingOptions.resolve(pm, False, None, {"model_type": "llama"}, SMOLLM2_TEMPLATE)
    assert not off.enable_auto_tool_choice and off.unread_reason is None and off.tool_template is None


# ---- served: tiny checkpoints of each family ------------------------------------------------------------------

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512)


def _config(family: str, vocab: int):
    if family == "qwen3":
        return transformers.Qwen3Config(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        **BASE)
    if family == "gemma2":
        return transformers.Gemma2Config(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         sliding_window=64, **BASE)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, sliding_window=64, **BASE)
    raise ValueError(family)


# gpt-oss is left to the table's tests: its experts' kernels take minutes to build in a fresh tree
TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "gemma2": GEMMA2_TEMPLATE, "gemma3": GEMMA3_TEMPLATE}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def family_server(request, tmp_path_factory):
    """A server with no tool flags over a tiny checkpoint of the family (dummy weights)."""
    family = request.param
    default = ensure_default_model()
    out = tmp_path_factory.mktemp(f"chat-{family}")
    tokenizer_config = json.loads((default / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TEMPLATES[family]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(default / "tokenizer.json", out / "tokenizer.json")
    vocab = transformers.PreTrainedTokenizerFast(tokenizer_file=str(default / "tokenizer.json")).vocab_size
    config = _config(family, vocab)
    config.architectures = [{"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                             "gemma3": "Gemma3ForCausalLM"}[family]]
    config.save_pretrained(str(out))
    engine = LLM(model=str(out), load_format="dummy", dtype="float32", cpu_threads=1, max_model_len=512,
                 kv_cache_memory_bytes=8 << 20).engine
    srv = ServerThread(build_app(AsyncLLMEngine(engine))).start()
    yield family, srv
    srv.stop()


def _chat(server, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 2,
            "temperature": 0, "return_prompt_text": True, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_system_message_is_folded_into_the_first_user_turn_or_refused_as_the_familys_template_says(
        family_server):
    family, server = family_server
    system = {"role": "system", "content": "Answer in French."}
    resp = _chat(server, messages=[system, {"role": "user", "content": "Hi"}])
    if family == "gemma2":  # its template refuses the role: a 400 that names it, as vLLM answers
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "messages" and "System role not supported" in error["message"]
        return
    assert resp.status_code == 200, resp.text
    prompt = resp.json()["prompt_text"]
    if family == "gemma3":
        assert "<start_of_turn>user\nAnswer in French.\n\nHi<end_of_turn>" in prompt
    else:
        assert "Answer in French." in prompt


def test_chat_template_kwargs_reach_the_template(family_server):
    family, server = family_server
    if family != "qwen3":
        pytest.skip("the thinking switch is Qwen3's")
    thinking = _chat(server).json()["prompt_text"]
    quiet = _chat(server, chat_template_kwargs={"enable_thinking": False}).json()["prompt_text"]
    assert thinking.endswith("<|im_start|>assistant\n") and quiet == thinking + "<think>\n\n</think>\n\n"


def test_tools_with_auto_are_read_where_a_parser_fits_and_answered_as_text_with_a_warning_where_none_does(
        family_server):
    family, server = family_server
    resp = _chat(server, tools=[WEATHER])
    assert resp.status_code == 200, resp.text
    if family == "qwen3":  # hermes, the family's own template shows the tools
        assert WARNING_HEADER not in resp.headers and "<tools>" in resp.json()["prompt_text"]
        return
    warning = resp.headers[WARNING_HEADER]
    assert "answered as text" in warning and "pythonic" in warning
    assert resp.json()["choices"][0]["message"].get("tool_calls") is None
    # a named function still calls it: the answer is held to the call's schema, no parser needed
    named = _chat(server, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  max_tokens=8)
    assert named.status_code == 200 and WARNING_HEADER not in named.headers
    # the Responses API answers the same way
    responses = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "input": "Weather in Paris?", "max_output_tokens": 2, "tools": [{"type": "function", **WEATHER["function"]}]})
    assert responses.status_code == 200 and "answered as text" in responses.headers[WARNING_HEADER]
