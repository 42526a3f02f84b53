"""Request bodies of the OpenAI API (plus the fields vLLM adds), validated by pydantic.

Every field of OpenAI's completions and chat completions request schemas, and every field vLLM adds to them, is
accepted: those that mean something here are served, and those that cannot (``store``, ``service_tier``,
``kv_transfer_params``, ...) are listed in each request's ``IGNORED_FIELDS``. A field of no schema at all is
accepted too (``extra="allow"`` on the top-level bodies only) unless the server runs with
``--strict-request-fields``, which answers it with OpenAI's 400. The server logs each ignored or unknown name
once and names the ones a request sent in the ``x-pagoda-ignored-fields`` response header
(docs/request_compatibility.md). Ranges and sizes live here (the sizes in ``request_body``), so a bad value is a
400 that names the field before any engine work happens.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Field

from pagoda.plugins.entrypoints.server.effort import Effort
from pagoda.plugins.entrypoints.server.request_body import (MAX_CONTENT_PARTS, MAX_ID_CHARS, MAX_LOGIT_BIAS,
                                                            MAX_MESSAGES, MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS,
                                                            MAX_METADATA_VALUE_CHARS, MAX_NAME_CHARS, MAX_PROMPTS,
                                                            MAX_SHORT_LIST, MAX_STOP, MAX_STOP_CHARS,
                                                            MAX_STOP_TOKEN_IDS, MAX_TOKEN_IDS, MAX_TOOL_CALLS,
                                                            MAX_TOOLS, list_bound, RequestBody)
from pagoda.plugins.entrypoints.server.structured import ResponseFormat, StructuredOutputFields
from pagoda.sampling_params import MAX_TOP_K

MAX_N = 16  # sequences per request
# seeds go to torch.Generator.manual_seed (64-bit); request i of n uses seed + i
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1 - MAX_N

NonEmptyStr = Annotated[str, Field(min_length=1)]
Identifier = Annotated[str, Field(max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], list_bound(MAX_TOKEN_IDS, min_items=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
# OpenAI's metadata: up to 16 pairs of short strings
Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Field(max_length=MAX_METADATA_KEYS)]
TokenIdText = Annotated[str, Field(max_length=24)]  # a token id written as a string: a logit_bias key


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)
    include_obfuscation: Optional[bool] = None  # pagoda never pads chunks: true is ignored


# OpenAI's chat fields that have no meaning for a local engine: accepted, logged once, named in a header
# (reasoning_effort only where the chat template reads no effort: effort.py)
_IGNORED_CHAT_FIELDS = ("store", "metadata", "service_tier", "prediction", "modalities",
                        "audio", "reasoning_effort", "web_search_options", "verbosity", "prompt_cache_key",
                        "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "moderation")
# vLLM's fields of both routes that have no effect here (disaggregated serving, its extensions)
_IGNORED_VLLM_FIELDS = ("watermarking", "logprob_token_ids", "session_id",
                        "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
                        "repetition_detection", "thinking_token_budget", "stream_interval",
                        "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs")
# vLLM's chat-only fields without effect here: multimodal inputs, reasoning parsers
_IGNORED_VLLM_CHAT_FIELDS = ("media_io_kwargs", "mm_processor_kwargs", "include_reasoning")
# the values of ignored fields that ask for nothing (vLLM's defaults): sent, they are not named as ignored
NO_EFFECT_VALUES = {"routed_experts_prompt_start": 0,
                    "return_token_offsets": False, "return_mm_kwargs": True, "include_reasoning": True,
                    "store": False, "watermarking": False}
MAX_BAD_WORDS = 256
AnyJSON = Optional[Any]  # an ignored field: any JSON value


class TopLevelBody(RequestBody):
    """A request's top-level body: fields of no schema are kept in ``model_extra`` (ignored and named, or refused
    with ``--strict-request-fields``); nested objects still refuse them."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return list(self.model_extra or ())


class SamplingFields(StructuredOutputFields, TopLevelBody):
    """Fields shared by completions and chat completions (the structured-output ones in ``structured.py``)."""

    model: Optional[Identifier] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[Annotated[dict[TokenIdText, Annotated[float, Field(ge=-100, le=100)]],
                                   Field(max_length=MAX_LOGIT_BIAS)]] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Union[None, StopString, Annotated[list[StopString], list_bound(MAX_STOP)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Identifier] = None
    # the extra sampling fields vLLM accepts
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[Annotated[list[TokenId], list_bound(MAX_STOP_TOKEN_IDS)]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, ge=-(2 ** 31), le=2 ** 31 - 1)
    # vLLM's: the logprobs of each prompt token (the first has none), in the response's prompt_logprobs
    prompt_logprobs: Optional[int] = Field(None, ge=0)
    response_format: Optional[ResponseFormat] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], list_bound(MAX_TOKEN_IDS, min_items=1)]] = None
    bad_words: Optional[Annotated[list[NonEmptyStr], list_bound(MAX_BAD_WORDS)]] = None
    # keep the prompt's last N tokens (-1: as many as the context holds); truncation_side "right" keeps the first
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, le=MAX_TOKEN_IDS)
    truncation_side: Optional[Literal["left", "right"]] = None
    request_id: Optional[Identifier] = None  # the response's id is the route's prefix and this
    return_token_ids: Optional[bool] = None  # prompt_token_ids and each choice's token_ids in the response
    return_tokens_as_token_ids: Optional[bool] = None  # logprobs name tokens "token_id:<id>"
    # vLLM's beam search: n is the beam width (serving.beam_search_params)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    # vLLM's, accepted without effect here (IGNORED_FIELDS)
    watermarking: AnyJSON = None
    logprob_token_ids: AnyJSON = None
    session_id: Optional[Identifier] = None
    cache_salt: AnyJSON = None
    kv_transfer_params: AnyJSON = None
    ec_transfer_params: AnyJSON = None
    vllm_xargs: AnyJSON = None
    repetition_detection: AnyJSON = None
    thinking_token_budget: AnyJSON = None
    stream_interval: AnyJSON = None
    routed_experts_prompt_start: AnyJSON = None
    return_token_offsets: AnyJSON = None
    return_mm_kwargs: AnyJSON = None

    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = _IGNORED_VLLM_FIELDS


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""
    prompt: Union[NonEmptyStr, TokenIds, Annotated[list[NonEmptyStr], list_bound(MAX_PROMPTS, min_items=1)],
                  Annotated[list[TokenIds], list_bound(MAX_PROMPTS, min_items=1)]]
    max_tokens: Optional[int] = Field(16, ge=0)  # 0: the prompt only (with echo and logprobs: scored)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True
    prompt_embeds: AnyJSON = None  # vLLM's embeddings in place of a prompt: refused (token or text prompts only)


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCall(RequestBody):
    name: NonEmptyStr
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(RequestBody):
    """A tool call of an earlier assistant message."""

    id: Identifier
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Annotated[list[TextPart], list_bound(MAX_CONTENT_PARTS)], None] = None
    # OpenAI documents no format for a participant's name (its older documents: 64 characters of
    # [a-zA-Z0-9_-]); any text is taken, as templates render it as text, within a bound
    name: Optional[Annotated[str, Field(max_length=MAX_NAME_CHARS)]] = None
    tool_call_id: Optional[Identifier] = None
    tool_calls: Optional[Annotated[list[ToolCall], list_bound(MAX_TOOL_CALLS)]] = None


# OpenAI's rule for function names
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(RequestBody):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: FunctionName


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], list_bound(MAX_MESSAGES, min_items=1)]
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    # vLLM's chat fields: how the messages are rendered
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open for the answer to continue
    echo: bool = False  # the answer's content starts with the last message's when that is the assistant's
    add_special_tokens: bool = False  # the tokenizer's special tokens on top of the template's
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the template (enable_thinking)
    documents: Optional[Annotated[list[dict[str, Any]], list_bound(MAX_MESSAGES)]] = None  # for RAG templates
    chat_template: Optional[str] = None  # refused: the server renders with its own template
    return_prompt_text: Optional[bool] = None  # the rendered prompt in the response's prompt_text
    media_io_kwargs: AnyJSON = None
    mm_processor_kwargs: AnyJSON = None
    include_reasoning: AnyJSON = None
    tools: Optional[Annotated[list[ChatTool], list_bound(MAX_TOOLS, min_items=1)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    # the chat template's reasoning_effort (and enable_thinking) variables (effort.py)
    reasoning_effort: Optional[Effort] = None
    # accepted for compatibility, without effect here (IGNORED_FIELDS)
    store: Optional[bool] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[Identifier] = None
    prediction: Optional[dict[str, Any]] = None
    modalities: Optional[Annotated[list[Identifier], list_bound(MAX_SHORT_LIST)]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    verbosity: Optional[Identifier] = None
    prompt_cache_key: Optional[Identifier] = None
    prompt_cache_retention: Optional[Identifier] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[Identifier] = None
    moderation: Optional[dict[str, Any]] = None

    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = _IGNORED_CHAT_FIELDS + _IGNORED_VLLM_FIELDS + _IGNORED_VLLM_CHAT_FIELDS


class TokenizeRequest(RequestBody):
    """``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: Optional[Identifier] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], list_bound(MAX_MESSAGES, min_items=1)]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    """``POST /detokenize``."""

    model: Optional[Identifier] = None
    tokens: Annotated[list[TokenId], list_bound(MAX_TOKEN_IDS)]
