"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, stateless use plus stored responses).

A field of no schema is ignored and named (refused with ``--strict-request-fields``), as on the other routes.
vLLM's extra fields are accepted: the sampling ones are served, the rest listed in ``IGNORED_FIELDS`` with
OpenAI's fields that change nothing on this server; the fields pagoda cannot serve (background runs, stored prompts, conversations,
moderation) are accepted by the schema and refused with a 400 by the handler, so the message can say why.
Tools are function tools, in the Responses API's flat shape; a hosted tool (web search, file search, ...) is a
400 naming its type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, model_validator

from pagoda.plugins.entrypoints.server.effort import Effort
from pagoda.plugins.entrypoints.server.protocol import (AnyJSON, FunctionName, Identifier, Metadata, TokenIdText,
                                                        TopLevelBody)
from pagoda.plugins.entrypoints.server.structured import StructuredOutputsField
from pagoda.sampling_params import MAX_TOP_K
from pagoda.plugins.entrypoints.server.request_body import (MAX_ANNOTATIONS, MAX_CONTENT_PARTS, MAX_ID_CHARS,
                                                            MAX_MESSAGES, MAX_SHORT_LIST, MAX_TOKEN_IDS, MAX_TOOLS,
                                                            list_bound, RequestBody)
from pagoda.sampling_params import MAX_LOGPROBS

CallId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]

# OpenAI's fields that have no effect here: accepted, and named in the x-pagoda-ignored-fields header
IGNORED_FIELDS = ("access_programs", "background_options", "context_management", "image", "include",
                  "max_tool_calls", "metadata", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
                  "safety_identifier", "service_tier", "stream_options", "truncation", "user",
                  # vLLM's
                  "mm_processor_kwargs", "cache_salt", "enable_response_messages", "previous_input_messages")
# the one value of ``include`` that means something here: logprobs of the output text
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def _str_or_list(value: Any) -> Optional[str]:
    """The union branch of a "string or list" field; the tags are the names the error messages leave out."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list[item]"
    return None


def _text_or_list_of(item: Any, what: str, max_items: int, min_items: int = 0) -> Any:
    items = Annotated[list[item], list_bound(max_items, min_items), Tag("list[item]")]
    return Annotated[Union[Annotated[str, Tag("str")], items],
                     Discriminator(_str_or_list, custom_error_type="str_or_list",
                                   custom_error_message=f"must be a string or a list of {what}")]


class ContentPart(RequestBody):
    """str content of an input message: ``input_text``, or ``output_text`` sent back from an earlier output."""

    type: Literal["input_text", "output_text"]
    text: str
    # what an output_text part carries when a client sends an earlier output back; not read
    annotations: Optional[Annotated[list[Any], list_bound(MAX_ANNOTATIONS)]] = None
    logprobs: Optional[Annotated[list[Any], list_bound(MAX_TOKEN_IDS)]] = None
    prompt_cache_breakpoint: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "input_text", "output_text"):
            raise ValueError(f"content parts of type {data['type']!r} are not served: this model reads text only; "
                             "send input_text parts")
        return data


class InputMessage(RequestBody):
    """A message of the conversation; ``type`` may be left out (OpenAI's "easy" input message)."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: _text_or_list_of(ContentPart, "content parts", MAX_CONTENT_PARTS)
    # what an output message carries when a client sends it back as input; not read
    id: Optional[Identifier] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None

    @model_validator(mode="before")
    @classmethod
    def _messages_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "message"):
            raise ValueError(f"input items of type {data['type']!r} are not served on /v1/responses; send messages "
                             "with text content, function_call items and function_call_output items")
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestBody):
    """A call of a function tool the model made, sent back as input (an output item of an earlier response)."""

    type: Literal["function_call"]
    call_id: CallId
    name: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
    arguments: str  # JSON, as the model wrote it
    # what an output item carries; not read
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class OutputTextPart(RequestBody):
    """str in a function call's output: ``input_text`` (OpenAI's name, the output goes back into the model)."""

    type: Literal["input_text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "input_text"):
            raise ValueError(f"function call outputs of type {data['type']!r} are not served: this model reads text "
                             "only; send the output as a string or as input_text parts")
        return data


class FunctionCallOutputItem(RequestBody):
    """What a function call returned, answering the call ``call_id`` (of this input or of the stored
    conversation)."""

    type: Literal["function_call_output"]
    call_id: CallId
    output: _text_or_list_of(OutputTextPart, "input_text parts", MAX_CONTENT_PARTS)
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(value: Any) -> str:
    """The union branch of an input item, by its ``type`` (anything else is a message, whose check names the
    type). The tags begin ``literal[`` so that error messages leave them out of the field's path."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"literal[{kind}]" if kind in ("function_call", "function_call_output") else "literal[message]"


InputItem = Annotated[Union[Annotated[InputMessage, Tag("literal[message]")],
                            Annotated[FunctionCallItem, Tag("literal[function_call]")],
                            Annotated[FunctionCallOutputItem, Tag("literal[function_call_output]")]],
                      Discriminator(_item_kind)]


_CHAT_SHAPE = ("this is {what} in chat completions' shape, with the function nested under \"function\"; the "
               "Responses API writes it flat: {example}")


class FunctionTool(RequestBody):
    """A function the model may call, in the Responses API's flat shape (chat nests the same under
    ``function``)."""

    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "function"):
            raise ValueError(f"tools of type {data['type']!r} are not served: pagoda runs no hosted tools (web "
                             "search, file search, code interpreter, computer use, MCP, image generation, shell, "
                             "...); send function tools, {\"type\": \"function\", \"name\": ..., \"parameters\": "
                             "{...}}, and run them in your own code")
        if isinstance(data, dict) and "function" in data and "name" not in data:
            raise ValueError(_CHAT_SHAPE.format(what="a tool", example='{"type": "function", "name": ..., '
                                                                       '"description": ..., "parameters": {...}}'))
        return data

    def as_chat_tool(self) -> dict:
        """The tool in chat completions' shape, which chat templates and tool-call parsers take."""
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class ToolChoiceFunction(RequestBody):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    name: FunctionName

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "function"):
            raise ValueError(f"tool_choice of type {data['type']!r} is not served: pagoda runs function tools "
                             "only; send \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}")
        if isinstance(data, dict) and "function" in data and "name" not in data:
            raise ValueError(_CHAT_SHAPE.format(what="a tool choice", example='{"type": "function", "name": ...}'))
        return data


def _choice_kind(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return "str"
    if isinstance(value, (dict, ToolChoiceFunction)):
        return "dict[function]"
    return None


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("str")],
                             Annotated[ToolChoiceFunction, Tag("dict[function]")]],
                       Discriminator(_choice_kind, custom_error_type="tool_choice",
                                     custom_error_message='must be "none", "auto", "required" or '
                                                          '{"type": "function", "name": ...}')]


class TextFormatText(RequestBody):
    type: Literal["text"]


class TextFormatJSONSchema(RequestBody):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextFormatJSONObject(RequestBody):
    type: Literal["json_object"]


class TextConfig(RequestBody):
    format: Optional[Annotated[Union[TextFormatText, TextFormatJSONSchema, TextFormatJSONObject],
                               Field(discriminator="type")]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # no effect here


class ResponsesStreamOptions(RequestBody):
    include_obfuscation: Optional[bool] = None  # no effect here: events carry no padding


class ReasoningConfig(RequestBody):
    """OpenAI's ``reasoning``: ``effort`` reaches the chat template (effort.py); no summaries are written."""

    effort: Optional[Effort] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # no effect here
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None  # its older name


class ResponsesRequest(TopLevelBody):
    """``POST /v1/responses``."""

    model: Optional[Identifier] = None
    input: _text_or_list_of(InputItem, "input items", MAX_MESSAGES, min_items=1)
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[Identifier] = None
    text: Optional[TextConfig] = None
    tools: Optional[Annotated[list[FunctionTool], list_bound(MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # with tool_choice "required", false allows one call only
    # refused by the handler when set: pagoda cannot serve them
    background: Optional[bool] = None
    conversation: Union[None, Identifier, dict[str, Any]] = None
    prompt: Optional[dict[str, Any]] = None
    moderation: Optional[dict[str, Any]] = None
    # no effect here (IGNORED_FIELDS); metadata and the identifiers are echoed in the response
    metadata: Optional[Metadata] = None
    user: Optional[Identifier] = None
    safety_identifier: Optional[Identifier] = None
    prompt_cache_key: Optional[Identifier] = None
    include: Optional[Annotated[list[Identifier], list_bound(MAX_SHORT_LIST)]] = None
    max_tool_calls: Optional[int] = Field(None, ge=0)
    reasoning: Optional[ReasoningConfig] = None
    service_tier: Optional[Identifier] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream_options: Optional[ResponsesStreamOptions] = None
    prompt_cache_retention: Optional[Identifier] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    background_options: Optional[dict[str, Any]] = None
    context_management: Optional[Annotated[list[dict[str, Any]], list_bound(MAX_SHORT_LIST)]] = None
    access_programs: Optional[dict[str, Any]] = None
    image: Optional[dict[str, Any]] = None
    # vLLM's extra fields: served
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    logit_bias: Optional[Annotated[dict[TokenIdText, Annotated[float, Field(ge=-100, le=100)]],
                                   Field(max_length=1024)]] = None
    skip_special_tokens: bool = True
    request_id: Optional[Identifier] = None  # the response's id
    priority: int = Field(0, ge=-(2 ** 31), le=2 ** 31 - 1)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    # vLLM's, without effect here
    mm_processor_kwargs: AnyJSON = None
    cache_salt: AnyJSON = None
    enable_response_messages: AnyJSON = None
    previous_input_messages: AnyJSON = None

    def ignored_fields(self) -> list[str]:
        """The fields of this request that have no effect here (``include`` only for values other than
        logprobs, ``text.verbosity`` too)."""
        names = [n for n in IGNORED_FIELDS if getattr(self, n) not in (None, False)
                 and not (n == "include" and set(self.include) <= {INCLUDE_LOGPROBS})]
        if self.text is not None and self.text.verbosity is not None:
            names.append("text.verbosity")
        return names

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or INCLUDE_LOGPROBS in (self.include or ())
