"""Which tool-call parser and chat template a checkpoint gets when ``pagoda serve`` is given no tool flags.

The family is read from the checkpoint's ``config.json`` (``model_type``, ``architectures``) and its chat
template: the template's own markers say what the model was trained to write (``<tool_call>`` for the Hermes
format, ``<|python_tag|>`` for Llama 3's JSON calls), the model type says the rest. Where the checkpoint's
template never shows the tools to the model (it does not read the ``tools`` variable) and pagoda ships a
template in the family's format, requests with tools are rendered with that one (``templates/`` beside this
package's parent). What was chosen and why is one :class:`ToolSetup`, logged at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

# model_type -> (the family's name in messages and docs, vLLM's parser name for it; None: no parser fits)
FAMILY_PARSERS: dict[str, tuple[str, Optional[str]]] = {
    "qwen2": ("Qwen2 / Qwen2.5", "hermes"),
    "qwen2_moe": ("Qwen2-MoE", "hermes"),
    "qwen3": ("Qwen3", "hermes"),
    "qwen3_moe": ("Qwen3-MoE", "hermes"),
    "smollm3": ("SmolLM3", "hermes"),
    "gemma2": ("Gemma 2", None),
    "gemma3": ("Gemma 3", None),
    "gemma3_text": ("Gemma 3", None),
    "gpt_oss": ("gpt-oss", "openai"),
    "granite": ("Granite", None),
    "olmo2": ("OLMo 2", None),
    "mistral": ("Mistral", None),
    "mixtral": ("Mixtral", None),
}

GEMMA_REASON = ("Gemma's own template shows no tools; with one that asks for Python calls, start the server with "
                "--chat-template FILE --tool-call-parser pythonic")
# why a family has no parser here, for the start-up log and the answer's warning
NO_PARSER_REASONS = {
    "gemma2": GEMMA_REASON,
    "gemma3": GEMMA_REASON,
    "gemma3_text": GEMMA_REASON,
    "granite": "Granite writes <|tool_call|> lists (vLLM's 'granite' parser), which pagoda does not read",
    "mistral": "Mistral writes [TOOL_CALLS] lists (vLLM's 'mistral' parser), which pagoda does not read",
    "mixtral": "Mixtral writes [TOOL_CALLS] lists (vLLM's 'mistral' parser), which pagoda does not read",
}

# vLLM's parsers pagoda has none of, and the format each reads, for the error that names one
VLLM_ONLY_PARSERS = {
    "mistral": "Mistral's [TOOL_CALLS] lists",
    "granite": "Granite's <|tool_call|> lists",
}

# the templates pagoda ships, by the parser whose format they write and the turn format they extend
SHIPPED_TEMPLATES = {("hermes", "chatml"): "chatml_hermes.jinja", ("llama3_json", "llama3"): "llama3_json.jinja"}


@dataclass(frozen=True)
class ToolSetup:
    """What a checkpoint gets for tools: ``parser`` (a ``pagoda_tool_parsers`` name, None when none fits),
    ``template`` (the text of the template requests with tools are rendered with; None: the tokenizer's own),
    ``template_name`` (the shipped file's name, for the log) and ``reason`` (how it was chosen, one sentence)."""

    family: str
    parser: Optional[str]
    template: Optional[str]
    template_name: Optional[str]
    reason: str


def turn_format(chat_template: str) -> Optional[str]:
    """The turn markers a chat template writes: ``chatml`` (``<|im_start|>``), ``llama3``
    (``<|start_header_id|>``), or None."""
    if "<|im_start|>" in chat_template:
        return "chatml"
    if "<|start_header_id|>" in chat_template:
        return "llama3"
    return None


def shows_tools(chat_template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (else the model never sees the tools)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return "tools" in chat_template


def parser_for(model_type: str, chat_template: str) -> tuple[str, Optional[str], str]:
    """The family, its parser (None: none fits) and why, from the checkpoint's ``model_type`` and template."""
    family, parser = FAMILY_PARSERS.get(model_type, (model_type or "unknown", None))
    if "<tool_call>" in chat_template:
        return family, "hermes", "its chat template writes <tool_call> tags"
    if "<|python_tag|>" in chat_template or ("<|start_header_id|>" in chat_template and "ipython" in chat_template):
        return family, "llama3_json", "its chat template takes Llama 3 JSON tool calls"
    if parser is not None:
        return family, parser, f"model_type {model_type!r}"
    if model_type in NO_PARSER_REASONS:
        return family, None, NO_PARSER_REASONS[model_type]
    fmt = turn_format(chat_template)
    if fmt == "chatml":
        return f"ChatML ({family})", "hermes", "its chat template is ChatML, which the Hermes tool format extends"
    if fmt == "llama3":
        return f"Llama 3 ({family})", "llama3_json", "its chat template is Llama 3's"
    return family, None, (f"no tool-call format is known for model_type {model_type!r} and its chat template has "
                          "no tool-call markers")


def detect_tool_setup(hf_config: dict, chat_template: Optional[str], parser: Optional[str] = None,
                      template_given: bool = False) -> ToolSetup:
    """The tool setup of a checkpoint. ``parser``: the one named by ``--tool-call-parser`` (None: the family's);
    ``template_given``: ``--chat-template`` was given, so its template is used as it is."""
    text_config = hf_config.get("text_config", hf_config)
    model_type = str(text_config.get("model_type") or hf_config.get("model_type") or "")
    template_text = chat_template or ""
    family, detected, reason = parser_for(model_type, template_text)
    if parser is not None:
        detected, reason = parser, "named by --tool-call-parser"
    if detected is None or template_given or not template_text or shows_tools(template_text):
        return ToolSetup(family, detected, None, None, reason)
    shipped = SHIPPED_TEMPLATES.get((detected, turn_format(template_text)))
    if shipped is None:
        return ToolSetup(family, detected, None, None, reason + "; its chat template does not show tools to the model")
    return ToolSetup(family, detected, (TEMPLATES_DIR / shipped).read_text(), shipped,
                     reason + "; its own template does not show tools")
