"""Request bodies of the OpenAI API (plus the sampling fields vLLM adds), validated by pydantic.

Every field of OpenAI's completions and chat completions request schemas is accepted: those that mean
something here are served, and those that cannot (``store``, ``service_tier``, ``audio``, ...) are listed in
each request's ``IGNORED_FIELDS``: the server logs each such name once and names the ones a request sent in
the ``x-pagoda-ignored-fields`` response header. A field of no OpenAI or vLLM schema is rejected, as OpenAI
rejects it. Ranges live here, so a bad value is a 400 that names the field before any engine work happens.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pagoda.plugins.entrypoints.server.structured import ResponseFormat, StructuredOutputFields
from pagoda.sampling_params import MAX_LOGPROBS, MAX_TOP_K

MAX_N = 16  # sequences per request
MAX_STOP = 16  # stop strings per request
# seeds go to torch.Generator.manual_seed (64-bit); request i of n uses seed + i
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1 - MAX_N


def _encodable(text: str) -> str:
    """JSON may carry unpaired UTF-16 surrogates (``"\\ud83d"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains an unpaired UTF-16 surrogate ({text[exc.start]!a}) at character {exc.start}; "
                         "send valid Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
NonEmptyStr = Annotated[Text, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # pagoda never pads chunks: true is ignored


# OpenAI's chat fields that have no meaning for a local engine: accepted, logged once, named in a header
_IGNORED_CHAT_FIELDS = ("store", "metadata", "service_tier", "prediction", "modalities",
                        "audio", "reasoning_effort", "web_search_options", "verbosity", "prompt_cache_key",
                        "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "moderation")


class SamplingFields(StructuredOutputFields):
    """Fields shared by completions and chat completions (the structured-output ones in ``structured.py``)."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Union[None, NonEmptyStr, Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # the extra sampling fields vLLM accepts
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, ge=-(2 ** 31), le=2 ** 31 - 1)
    # vLLM's: the logprobs of each prompt token (the first has none), in the response's prompt_logprobs
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ()


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Union[NonEmptyStr, Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[NonEmptyStr], Field(min_length=1, max_length=64)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]]
    max_tokens: Optional[int] = Field(16, ge=0)  # 0: the prompt only (with echo and logprobs: scored)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[Text] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: NonEmptyStr
    arguments: Text  # JSON, as OpenAI sends it


class ToolCall(_Body):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Optional[Text] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


# OpenAI's rule for function names
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(_Body):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    add_generation_prompt: bool = True
    tools: Optional[Annotated[list[ChatTool], Field(min_length=1, max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    # accepted for compatibility, without effect here (IGNORED_FIELDS)
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prediction: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    moderation: Optional[dict[str, Any]] = None

    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = _IGNORED_CHAT_FIELDS


class TokenizeRequest(_Body):
    """``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: Optional[str] = None
    prompt: Optional[Text] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: Optional[str] = None
    tokens: list[TokenId]
