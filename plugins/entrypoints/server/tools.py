"""Tool calling on ``/v1/chat/completions`` (and, by the same rules, ``/v1/responses``): what ``tools`` and
``tool_choice`` mean for one request.

- ``none`` (the default without tools): the tools reach the chat template, the answer is plain content.
- ``auto`` (the default with tools): the answer is read into content and ``tool_calls`` by the server's tool-call
  parser, the model family's (:mod:`~pagoda.plugins.entrypoints.server.tool_families`) or ``--tool-call-parser
  NAME``'s; when no parser fits the model, the answer is text and the response carries a warning.
- ``required``, or a named function: the answer is held to a JSON schema of the calls through structured
  outputs (:func:`tool_choice_schema`), then read back into ``tool_calls``.

History goes to the template as Hugging Face templates expect it: an assistant message's ``tool_calls`` with
their arguments as a dict, a tool message with its ``tool_call_id``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.protocol import ChatCompletionRequest, ChatMessage
from pagoda.plugins.entrypoints.server.request_body import UnusableJSON, load_json_text
from pagoda.plugins.entrypoints.server.tool_families import VLLM_ONLY_PARSERS, ToolSetup, detect_tool_setup
from pagoda.plugins.entrypoints.tool_parsers.forced import ForcedToolCallParser
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.tool_calls import DeltaMessage, ExtractedToolCalls

logger = logging.getLogger("pagoda.server")

TOOL_PARSERS_HOOK = "pagoda_tool_parsers"
# the response header that says a request's tool_choice "auto" was answered as text
WARNING_HEADER = "x-pagoda-warning"


@dataclass(frozen=True)
class ToolCallingOptions:
    """How the server reads tool calls: the parser that reads ``auto`` answers, the template requests with tools
    are rendered with, and what ``auto`` does without a parser.

    ``enable_auto_tool_choice``: ``auto`` is read by ``parser_name``'s parser. Without it, ``unread_reason`` set
    means no parser fits the model and ``auto`` is answered as text with a warning; left None, tool calls were
    turned off (``--no-enable-auto-tool-choice``) and ``auto`` is a 400. ``tool_template``: the text of the
    template for requests with tools (None: the tokenizer's own). ``setup`` says how they were chosen."""

    enable_auto_tool_choice: bool = False
    parser_name: Optional[str] = None
    parser_factory: Any = None  # a pagoda.interfaces.ToolParserFactory
    available_parsers: tuple[str, ...] = ()
    tool_template: Optional[str] = None
    unread_reason: Optional[str] = None
    setup: Optional[ToolSetup] = None

    @classmethod
    def resolve(cls, plugin_manager: Any, enable_auto_tool_choice: Optional[bool] = None,
                tool_call_parser: Optional[str] = None, hf_config: Optional[dict] = None,
                chat_template: Optional[str] = None, template_given: bool = False) -> "ToolCallingOptions":
        """The options from the server's flags and its checkpoint. ``enable_auto_tool_choice``: None (no flag: the
        model family's parser and template, see :mod:`~pagoda.plugins.entrypoints.server.tool_families`), True
        (``--enable-auto-tool-choice``: a parser is required, the family's or ``tool_call_parser``) or False
        (``--no-enable-auto-tool-choice``: off). ``hf_config`` and ``chat_template`` are the checkpoint's
        ``config.json`` and the tokenizer's template (None: not known yet, only the flags are checked);
        ``template_given``: ``--chat-template`` was given, so no template replaces it. A ConfigError lists the
        parsers there are."""
        available = tuple(plugin_manager.names(TOOL_PARSERS_HOOK))
        if enable_auto_tool_choice is False:
            if tool_call_parser:
                raise ConfigError("--no-enable-auto-tool-choice turns tool-call parsing off, and --tool-call-parser "
                                  "names a parser to read them: give one of the two")
            return cls(available_parsers=available)
        factory = None
        if tool_call_parser in VLLM_ONLY_PARSERS and tool_call_parser not in available:
            raise ConfigError(f"--tool-call-parser {tool_call_parser}: vLLM's parser for "
                              f"{VLLM_ONLY_PARSERS[tool_call_parser]} is not in pagoda (installed: "
                              f"{', '.join(available) or 'none'}; a plugin can add one, see pagoda_tool_parsers); "
                              "without the flag, tool_choice \"auto\" is answered as text and \"required\" or a "
                              "named function still calls tools")
        if tool_call_parser:
            factory = plugin_manager.get(TOOL_PARSERS_HOOK, tool_call_parser, "--tool-call-parser").factory
        if hf_config is None:
            if enable_auto_tool_choice and not tool_call_parser:
                raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME when the model is not known "
                                  f"(available: {', '.join(available) or 'none'})")
            return cls(bool(tool_call_parser), tool_call_parser, factory, available)
        setup = detect_tool_setup(hf_config, chat_template, tool_call_parser, template_given)
        if setup.parser is None:
            if enable_auto_tool_choice:
                raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser NAME: no parser fits this "
                                  f"{setup.family} model ({setup.reason}); available: {', '.join(available) or 'none'}")
            return cls(available_parsers=available, unread_reason=setup.reason, setup=setup)
        if setup.parser not in available:  # the family's parser is not installed (a plugin blocked, say)
            reason = f"its family's parser {setup.parser!r} is not installed"
            if enable_auto_tool_choice:
                raise ConfigError(f"--enable-auto-tool-choice: {reason}; name one with --tool-call-parser NAME "
                                  f"(available: {', '.join(available) or 'none'})")
            return cls(available_parsers=available, unread_reason=reason, setup=setup)
        factory = plugin_manager.get(TOOL_PARSERS_HOOK, setup.parser, "--tool-call-parser").factory
        return cls(True, setup.parser, factory, available, setup.template, None, setup)

    @classmethod
    def for_engine(cls, engine: Any, enable_auto_tool_choice: Optional[bool] = None,
                   tool_call_parser: Optional[str] = None) -> "ToolCallingOptions":
        """:meth:`resolve` for a built engine (a :class:`~pagoda.engine.llm_engine.LLMEngine`): its checkpoint's
        config, its tokenizer's template, and whether ``--chat-template`` replaced it."""
        model = engine.config.model
        template = engine.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: a "tool_use" one shows tools when the default does not
            template = "\n".join(template.values())
        return cls.resolve(engine.pm, enable_auto_tool_choice, tool_call_parser, model.hf_config, template,
                           template_given=model.chat_template is not None)

    def describe(self) -> str:
        """One line for the start-up log: the parser, the template and how they were chosen."""
        if self.setup is None:
            if self.enable_auto_tool_choice:
                return f"tool calls: tool_choice \"auto\" read by the {self.parser_name!r} parser"
            return "tool calls: off (--no-enable-auto-tool-choice): tool_choice \"auto\" is refused with a 400"
        setup = self.setup
        if not self.enable_auto_tool_choice:
            return (f"tool calls: no tool-call parser fits this {setup.family} model ({self.unread_reason}): "
                    "tool_choice \"auto\" is answered as text with a warning (\"required\" and named functions "
                    "still call tools); name a parser with --tool-call-parser NAME")
        template = (f"pagoda's {setup.template_name} template for requests with tools" if setup.template_name
                    else "the model's chat template")
        return (f"tool calls: tool_choice \"auto\" read by the {self.parser_name!r} parser and {template} "
                f"({setup.family}: {setup.reason}); override with --tool-call-parser NAME and --chat-template FILE, "
                "turn off with --no-enable-auto-tool-choice")

    def template_for(self, tools: Optional[list[dict]], messages: list[dict]) -> Optional[str]:
        """The template to render a chat with: the tool-aware one when the request has tools or its history has
        calls or results; None (the tokenizer's own) otherwise."""
        if self.tool_template is None:
            return None
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            return self.tool_template
        return None


# ---- the request ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """One request's tools and how its answers are read. ``choice`` is ``none``, ``auto``, ``required`` or
    ``function`` (then ``function_name`` is the one to call)."""

    tools: Optional[list[dict]]  # for the template, in OpenAI's shape
    choice: str
    function_name: Optional[str] = None
    parallel: bool = True
    parser_factory: Any = None  # for auto
    # why an ``auto`` request is answered as text (no parser fits the model): logged, and sent in WARNING_HEADER
    warning: Optional[str] = None

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params``, held to the calls' JSON schema when the tool choice is forced."""
        if not self.is_forced:
            return params
        schema = tool_choice_schema(self.tools, self.function_name, self.parallel)
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def explain_refusal(self, exc: InvalidRequestError) -> Exception:
        """The engine's refusal of the structured outputs a forced tool choice needs, said in the request's
        terms; any other error as it is."""
        if not self.is_forced or not (exc.param or "").startswith("structured_outputs"):
            return exc
        asked = repr("required") if self.choice == "required" else f"function {self.function_name!r}"
        return APIError(400, f"tool_choice {asked} is enforced with structured outputs, which this engine refused: "
                             f"{exc}; send tool_choice \"auto\" or \"none\" instead", param="tool_choice")

    def new_parser(self) -> Any:
        """A parser for one answer (a pagoda.interfaces.ToolParser), or None when answers are plain content."""
        if self.choice == "auto":
            return self.parser_factory(self.tools)
        if self.is_forced:
            return ForcedToolCallParser(self.tools)
        return None

    def message(self, text: str, reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """A whole answer as an assistant message, and its finish reason (``tool_calls`` when it made calls)."""
        parser = self.new_parser()
        if parser is None:
            return {"role": "assistant", "content": text}, reason
        found = parser.extract_tool_calls(text)
        message = {"role": "assistant", "content": found.content}
        if found.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in found.tool_calls]
        return message, _finish_reason(found, reason)

    def stream(self) -> "StreamedChoice":
        return StreamedChoice(self.new_parser())

    def warn(self, response: Any, logged: set[str]) -> None:
        """Put the request's warning (``auto`` answered as text) in the response's ``x-pagoda-warning`` header,
        and in the log the first time (``logged``: the server's set of warnings already logged)."""
        if self.warning is None:
            return
        response.headers[WARNING_HEADER] = self.warning
        if WARNING_HEADER not in logged:
            logged.add(WARNING_HEADER)
            logger.warning("%s (the %s response header says so; this is logged once)", self.warning, WARNING_HEADER)


class StreamedChoice:
    """One streamed answer's reader: each piece of text as OpenAI's delta (content, ``tool_calls`` pieces)."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.has_calls = False

    def delta(self, text: str, is_last: bool) -> dict:
        """The delta for the answer's next ``text`` (``is_last``: the answer ends with it)."""
        if self.parser is None:
            return {"content": text}
        message = self.parser.extract_tool_calls_streaming(text)
        if is_last:
            rest = self.parser.finish_streaming()
            message = DeltaMessage(message.content + rest.content, message.tool_calls + rest.tool_calls)
        delta: dict = {}
        if message.content:
            delta["content"] = message.content
        if message.tool_calls:
            delta["tool_calls"] = [piece.to_openai() for piece in message.tool_calls]
            self.has_calls = True
        return delta

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.has_calls and reason == "stop" else reason


def _finish_reason(found: ExtractedToolCalls, reason: Optional[str]) -> Optional[str]:
    return "tool_calls" if found.tool_calls and reason == "stop" else reason


# how each API writes a tool choice that names a function, for the messages that suggest one
CHAT_NAMED_CHOICE = '{"type": "function", "function": {"name": ...}}'


def plan_tools(body: ChatCompletionRequest, options: ToolCallingOptions) -> ToolRequest:
    """The request's tool choice, checked against its tools and the server's options (400s name the field)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return plan_tool_choice(tools, choice, None, body.parallel_tool_calls, options, CHAT_NAMED_CHOICE)
    return plan_tool_choice(tools, "function", choice.function.name, body.parallel_tool_calls, options,
                            CHAT_NAMED_CHOICE)


def plan_tool_choice(tools: Optional[list[dict]], choice: Optional[str], function_name: Optional[str],
                     parallel_tool_calls: Optional[bool], options: ToolCallingOptions,
                     named_choice: str) -> ToolRequest:
    """The rules of ``tool_choice`` that chat completions and the Responses API share. ``tools`` are in chat's
    shape (``{"type": "function", "function": {...}}``); ``choice`` is None (not given), ``none``, ``auto``,
    ``required`` or ``function`` (naming ``function_name``); ``named_choice`` is how the request's API writes a
    named function, for the message that suggests one."""
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: send the functions the model may call in tools, or leave "
                                "tool_choice out", param="tool_choice")
        return ToolRequest(None, "none")
    names = [t["function"]["name"] for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise APIError(400, f"tools has more than one function named {', '.join(map(repr, repeated))}; give each "
                            "tool a name of its own", param="tools")
    if choice is None or choice == "auto":
        if options.unread_reason is not None:
            return ToolRequest(tools, "none", warning=(
                f"tool_choice \"auto\" was answered as text: no tool-call parser fits this model "
                f"({options.unread_reason}); send tool_choice \"required\" or {named_choice} to get calls, or "
                "start the server with --tool-call-parser NAME"))
        if not options.enable_auto_tool_choice:
            default = " (the default when tools are given)" if choice is None else ""
            raise APIError(400, f"tool_choice \"auto\"{default} needs a tool-call parser, and this server runs with "
                                "tool calls off (--no-enable-auto-tool-choice); start it without that flag, or with "
                                "--enable-auto-tool-choice --tool-call-parser NAME (installed parsers: "
                                f"{', '.join(options.available_parsers) or 'none'}); or send tool_choice \"none\", "
                                f"\"required\" or {named_choice}", param="tool_choice")
        return ToolRequest(tools, "auto", parser_factory=options.parser_factory)
    if choice == "none":
        return ToolRequest(tools, "none")
    if choice == "required":
        return ToolRequest(tools, "required", parallel=parallel_tool_calls is not False)
    if function_name not in names:
        raise APIError(400, f"tool_choice names the function {function_name!r}, which is not in tools (they are "
                            f"{', '.join(map(repr, names))}); name one of them", param="tool_choice")
    return ToolRequest(tools, "function", function_name=function_name, parallel=False)


# ---- the schema of forced calls ---------------------------------------------------------------------


def tool_choice_schema(tools: list[dict], function_name: Optional[str] = None, parallel: bool = True) -> dict:
    """The JSON schema a forced answer is held to: for a named function, one object ``{"name": <that name>,
    "arguments": <its parameters>}``; for ``required``, such an object for any of the tools, or (``parallel``)
    an array of one or more. Each tool's parameters schema sits under ``$defs`` (its own ``$defs`` beside it,
    and its references rewritten), so references inside it still resolve."""
    chosen = [t for t in tools if function_name is None or t["function"]["name"] == function_name]
    defs: dict[str, Any] = {}
    calls = []
    for tool in chosen:
        name = tool["function"]["name"]
        defs.update(_hoist_parameters(name, tool["function"].get("parameters")))
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "arguments": {"$ref": f"#/$defs/{name}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    one_call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "items": one_call} if parallel and function_name is None else one_call
    return {**schema, "$defs": defs}


def _hoist_parameters(tool_name: str, parameters: Optional[dict]) -> dict[str, Any]:
    """``{tool_name: parameters, f"{tool_name}.{def}": ...}``: a tool's parameters schema and its definitions as
    root ``$defs`` entries, with every local reference (``#...``) rewritten to where its target went."""
    params = copy.deepcopy(parameters) if parameters else {"type": "object"}
    own_defs: dict[str, Any] = {}
    for section in ("definitions", "$defs"):
        if isinstance(params.get(section), dict):
            own_defs.update(params.pop(section))

    def moved(ref: str) -> str:
        pointer = ref[1:]
        for section in ("/$defs/", "/definitions/"):
            if pointer.startswith(section):
                return f"#/$defs/{tool_name}.{pointer[len(section):]}"
        return f"#/$defs/{tool_name}{pointer}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (moved(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    hoisted = {tool_name: rewrite(params)}
    hoisted.update({f"{tool_name}.{name}": rewrite(d) for name, d in own_defs.items()})
    return hoisted


def forced_tool_calls(tools: list[dict], text: str) -> ExtractedToolCalls:
    """A forced answer (JSON of :func:`tool_choice_schema`) read back into calls."""
    return ForcedToolCallParser(tools).extract_tool_calls(text)


# ---- history for the template -----------------------------------------------------------------------


def template_tool_fields(message: ChatMessage, position: int) -> dict:
    """The tool fields of one history message as a Hugging Face chat template expects them: ``tool_calls``
    (arguments decoded into a dict) on an assistant message, ``tool_call_id`` on a tool message."""
    where = f"messages[{position}]"
    fields: dict = {}
    if message.tool_calls:
        if message.role != "assistant":
            raise APIError(400, f"{where} is a {message.role} message with tool_calls; only assistant messages carry "
                                "tool calls", param=f"{where}.tool_calls")
        fields["tool_calls"] = [template_tool_call(call.id, call.function.name, call.function.arguments,
                                                   f"{where}.tool_calls[{i}].function.arguments")
                                for i, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        if not message.tool_call_id:
            raise APIError(400, f"{where} is a tool message without tool_call_id; give the id of the call it answers",
                           param=f"{where}.tool_call_id")
        fields["tool_call_id"] = message.tool_call_id
    return fields


def template_tool_call(call_id: str, name: str, arguments: str, param: Optional[str]) -> dict:
    """One call of an assistant message as a Hugging Face chat template takes it: its arguments decoded into a
    dict (templates print them with ``tojson``). Arguments that are not JSON are a 400 naming ``param``, where
    the request sent them; with ``param`` None (calls the model wrote, cut off by the token budget) they stay
    text."""
    if param is None:
        try:
            decoded: Any = load_json_text(arguments) if arguments.strip() else {}
        except ValueError:
            decoded = arguments
    else:
        decoded = _arguments(arguments, param)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": decoded}}


def _arguments(text: str, param: str) -> Any:
    try:
        return load_json_text(text) if text.strip() else {}
    except UnusableJSON as exc:
        raise APIError(400, f"{param} {exc}; send arguments the chat template can render", param=param) from None
    except ValueError as exc:
        raise APIError(400, f"{param} is not JSON ({exc}); send the arguments as a JSON text such as "
                            "'{\"city\": \"Paris\"}'", param=param) from None
