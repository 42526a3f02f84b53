"""What completions and chat share: model and length checks, sampling params, SSE frames, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.request_limits import DEFAULT_MAX_TOKENS, RequestLimits
from pagoda.execution.lora_request import LoRARequest
from pagoda.outputs import PromptLogprobs, RequestOutput
from pagoda.plugins.entrypoints.server.effort import EffortOptions
from pagoda.plugins.entrypoints.server.errors import APIError, error_body, to_api_error
from pagoda.plugins.entrypoints.server.frontend import FrontendOptions
from pagoda.plugins.entrypoints.server.protocol import NO_EFFECT_VALUES, SamplingFields
from pagoda.plugins.entrypoints.server.request_logging import RequestLog
from pagoda.plugins.entrypoints.server.tokenizer_turns import TokenizerTurns
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagoda.server")

IGNORED_FIELDS_HEADER = "x-pagoda-ignored-fields"
# a request may have this many times the characters of one longest prompt (--max-request-chars's default): with
# the per-prompt limit at max_model_len times the longest token (81 characters for SmolLM2), that is room for 64
# prompts of ordinary text (4-5 characters a token) that each fill the context, and for four prompts at the
# per-prompt limit, so one request's tokenizing is bounded by four prompts', not by the body size's 64
REQUEST_CHARS_FACTOR = 4

Item = TypeVar("Item")
Result = TypeVar("Result")


class ClientGone(Exception):
    """The client closed the connection; its requests were aborted."""


def answers_499_when_gone(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A route whose client left (:class:`ClientGone`) answers 499, nginx's "client closed request"."""
    @functools.wraps(route)
    async def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except ClientGone:
            return Response(status_code=499)
    return watched


# the header that names a request's tenant with --tenant-source header, and the characters of a tenant name kept
TENANT_HEADER = "x-pagoda-tenant"
TENANT_SOURCES = ("api-key", "header", "user")
MAX_TENANT_CHARS = 64

@dataclass(frozen=True)
class StreamUsage:
    """Where a stream carries its usage: ``final``, a chunk of its own before ``[DONE]``; ``continuous``, the
    usage so far in every chunk as well."""

    final: bool = False
    continuous: bool = False


@dataclass
class ServingContext:
    """The engine plus the facts every handler checks requests against.

    Prompts are tokenized on a thread of their own with a tokenizer of its own (fast tokenizers must not be
    shared between threads), so a long prompt never holds up the engine's steps; requests take turns on it
    (:class:`~pagoda.plugins.entrypoints.server.tokenizer_turns.TokenizerTurns`), so a large one never holds up
    the others; a completions request small enough (``TokenizerTurns.run_now``) is tokenized on the event loop
    instead, sparing it the hand-offs. Before any tokenizing, a request's text is bounded per prompt (:meth:`check_text_length`) and
    in all (:meth:`check_request_chars`).
    """

    engine: AsyncLLMEngine
    served_model_name: str
    max_model_len: int
    limits: RequestLimits  # the engine's: the rules of request lengths, written once
    tokenizer_turns: TokenizerTurns
    max_chars_per_token: int
    # characters a request may have in all its prompts or messages (--max-request-chars)
    max_request_chars: int
    # the output budget of a request that gives no max_tokens, cut to what the context leaves (None: all of it)
    default_max_tokens: Optional[int] = DEFAULT_MAX_TOKENS
    # what a request that does not set them samples with: the model's recommendation (its generation_config.json,
    # ModelConfig.sampling_defaults; its max_tokens replaces default_max_tokens)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # the ignored request fields already named in the log (each is logged once per server)
    logged_ignored_fields: set[str] = field(default_factory=set)
    # what `pagoda serve` was told about tool calls (a pagoda.plugins.entrypoints.server.tools.ToolCallingOptions)
    tool_options: Any = field(default=None)
    # the server's reasoning parser (a pagoda.plugins.entrypoints.server.reasoning.ReasoningOptions)
    reasoning_options: Any = field(default=None)
    # what the model's chat template does with a request's reasoning effort
    effort: EffortOptions = field(default_factory=EffortOptions)
    # where a request's tenant comes from (see tenant_of): "api-key", "header" or "user"
    tenant_source: str = "api-key"
    # --strict-request-fields: a field of no schema is a 400 (otherwise it is ignored and named)
    strict_request_fields: bool = False
    # vLLM's front-end flags: the response role, usage in every stream, token ids in logprobs, ...
    frontend: FrontendOptions = field(default_factory=FrontendOptions)
    # what is logged of each request (None: nothing; --enable-log-requests)
    request_log: Optional[RequestLog] = None

    def stream_usage(self, body: Any) -> "StreamUsage":
        """Where a stream carries its usage: as ``stream_options`` asks (``include_usage``, vLLM's
        ``continuous_usage_stats``), or everywhere with ``--enable-force-include-usage``, as on vLLM."""
        if self.frontend.enable_force_include_usage:
            return StreamUsage(True, True)
        options = body.stream_options
        if options is None or not options.include_usage:
            return StreamUsage()
        return StreamUsage(True, options.continuous_usage_stats)

    def tokens_as_token_ids(self, body: Any) -> bool:
        """Whether logprobs name tokens ``token_id:<id>``: the request's field, else the server's default."""
        given = body.return_tokens_as_token_ids
        return self.frontend.return_tokens_as_token_ids if given is None else given

    def tenant_of(self, request: Any, body: Any = None) -> Optional[str]:
        """The tenant a request counts for (the ``fair`` scheduling policy shares the engine between tenants):
        by ``tenant_source``, its ``x-pagoda-tenant`` header (``header``), the body's ``user`` field (``user``),
        or ``key:`` and the first 16 hex digits of the SHA-256 of its ``Authorization`` header (``api-key``: no
        key is ever kept). None when the request has none: such requests share one tenant."""
        if self.tenant_source == "user":
            user = getattr(body, "user", None)
            return user[:MAX_TENANT_CHARS] if user else None
        if self.tenant_source == "header":
            name = request.headers.get(TENANT_HEADER)
            return name[:MAX_TENANT_CHARS] if name else None
        auth = request.headers.get("authorization", "")
        if not auth:
            return None
        return "key:" + hashlib.sha256(auth.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    @classmethod
    def for_engine(cls, engine: AsyncLLMEngine, default_max_tokens: Optional[int] = DEFAULT_MAX_TOKENS,
                   max_request_chars: Optional[int] = None) -> "ServingContext":
        """The context of ``engine``'s server; ``max_request_chars`` None: ``REQUEST_CHARS_FACTOR`` times the
        per-prompt limit."""
        core = engine.engine
        tokenizer = copy.deepcopy(core.tokenizer)
        max_model_len, max_chars_per_token = core.config.model.max_model_len, longest_token_chars(tokenizer)
        if max_request_chars is None:
            max_request_chars = REQUEST_CHARS_FACTOR * max_model_len * max_chars_per_token
        return cls(engine, core.config.model.served_model_name, max_model_len, core.request_limits,
                   # small prompts tokenize on the event loop with the tokenizer of its output side
                   TokenizerTurns(tokenizer, engine.output_processor.tokenizer), max_chars_per_token, max_request_chars,
                   core.config.model.sampling_defaults.get("max_tokens", default_max_tokens),
                   sampling_defaults=core.config.model.sampling_defaults)

    async def run_tokenizer(self, fn: Callable[[Any], Result]) -> Result:
        """``fn(tokenizer)`` on the tokenizer thread, as one turn (bounded work: one prompt, one chat)."""
        return await self.tokenizer_turns.run(fn)

    async def run_tokenizer_each(self, fn: Callable[[Any, Item], Result], items: Iterable[Item]) -> list[Result]:
        """``fn(tokenizer, item)`` for each item on the tokenizer thread, one turn each."""
        return await self.tokenizer_turns.run_each(fn, items)

    @property
    def max_prompt_chars(self) -> int:
        """The characters of the longest prompt the context can hold: no token covers more than
        ``max_chars_per_token``."""
        return self.max_model_len * self.max_chars_per_token

    def check_text_length(self, text: str, param: str) -> None:
        """400 before tokenizing a text that cannot fit the context whatever its tokens are."""
        self.check_num_chars(len(text), param)

    def check_num_chars(self, num_chars: int, param: str) -> None:
        """400 before tokenizing ``num_chars`` characters of one prompt that no context can hold."""
        limit = self.max_prompt_chars
        if num_chars > limit:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, and the "
                                f"{param} has {num_chars} characters, more than any {self.max_model_len} tokens "
                                f"can hold (at most {limit}); shorten the {param}", param=param)

    def check_request_chars(self, lengths: Sequence[int], param: str, what: str) -> None:
        """400 before tokenizing a request whose texts (their ``lengths`` in characters: its prompts, its
        messages) have more than ``max_request_chars`` characters in all; ``what`` names them in the message."""
        num_chars = sum(lengths)
        if num_chars > self.max_request_chars:
            raise APIError(400, f"this request has {num_chars} characters in its {what}, more than the "
                                f"{self.max_request_chars} a request may have (--max-request-chars); send less text "
                                f"per request (split the {what} over several requests)", param=param)

    def check_model(self, name: Optional[str]) -> None:
        """404 unless ``name`` is None, the base model's name or a served LoRA adapter's."""
        self.resolve_model(name)

    def resolve_model(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 listing the served names
        for any other name."""
        if name is None or name == self.served_model_name:
            return None
        lora = self.engine.engine.loras.get(name)  # replaced, never changed in place, by the engine thread
        if lora is None:
            served = ", ".join(repr(n) for n in [self.served_model_name, *sorted(self.engine.engine.loras)])
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        return lora

    def model_name(self, lora: Optional[LoRARequest]) -> str:
        """The ``model`` of a response: the adapter's name, or the base model's."""
        return self.served_model_name if lora is None else lora.lora_name

    def check_unknown_fields(self, body: Any) -> None:
        """With ``--strict-request-fields``, OpenAI's 400 for a field of no OpenAI or vLLM schema."""
        unknown = body.unknown_fields()
        if unknown and self.strict_request_fields:
            raise APIError(400, f"unrecognized request argument supplied: {unknown[0]} (this server runs with "
                                "--strict-request-fields; remove the field)", param=unknown[0])

    def mark_ignored_fields(self, body: Any, response: Response, names: Optional[list[str]] = None) -> None:
        """Name the fields of ``body`` that pagoda accepts but ignores (``names``, or its ``IGNORED_FIELDS`` that
        were sent with a value asking for something), and those of no schema, in the response's
        ``x-pagoda-ignored-fields`` header; log a warning the first time each name is seen."""
        if names is None:
            names = [name for name in body.IGNORED_FIELDS
                     if getattr(body, name) is not None and getattr(body, name) != NO_EFFECT_VALUES.get(name)
                     and not (name == "reasoning_effort" and self.effort.is_read)]
            if body.stream_options is not None and body.stream_options.include_obfuscation:
                names.append("stream_options.include_obfuscation")
        unknown = body.unknown_fields()
        if not names and not unknown:
            return
        # a header holds latin-1 only: a field name outside it is written as its escaped repr
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(
            name if name.isascii() and name.isprintable() else ascii(name) for name in names + unknown)
        for name in names + unknown:
            if name not in self.logged_ignored_fields:
                self.logged_ignored_fields.add(name)
                why = ("is accepted for OpenAI and vLLM compatibility but has no effect in pagoda" if name in names
                       else "belongs to no OpenAI or vLLM request schema (--strict-request-fields refuses it)")
                logger.warning("the request field %r %s; it is ignored (the %s response header names it; this is "
                               "logged once)", name, why, IGNORED_FIELDS_HEADER)

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: Optional[int], param: str = "max_tokens") -> int:
        """The output budget: the request's (from its field ``param``), or ``default_max_tokens`` cut to what the
        context leaves; 400 when it cannot fit (the engine's
        :meth:`~pagoda.engine.request_limits.RequestLimits.fit_max_tokens`)."""
        return self.limits.fit_max_tokens(num_prompt_tokens, max_tokens, param, self.default_max_tokens)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token decodes to: its vocabulary string's length bounds it (byte-level BPE writes
    each byte as one character, and a character takes at least a byte), plus the added tokens' own text."""
    vocab = tokenizer.get_vocab()
    return max(1, max((len(t) for t in vocab), default=1))


def make_sampling_params(body: SamplingFields, max_tokens: int, logprobs: Optional[int],
                         prompt_logprobs: Optional[int] = None,
                         structured_outputs: Optional[StructuredOutputsParams] = None,
                         defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
    """The request's sampling fields; one it does not set takes the model's default (``defaults``: the
    ServingContext's ``sampling_defaults``), else OpenAI's (temperature 1, top_p 1), with vLLM's extra fields;
    InvalidRequestError names the field (``SamplingParams`` checks every range, ``min_tokens <= max_tokens`` too).
    ``structured_outputs``: the request's constraint (``structured.structured_outputs_of``)."""
    defaults = defaults or {}
    logit_bias = None
    if body.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids written as strings, e.g. {\"50256\": -100}",
                           param="logit_bias") from None
    return SamplingParams(
        n=body.n,
        temperature=defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
        top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
        top_k=defaults.get("top_k", 0) if body.top_k is None else body.top_k,
        min_p=defaults.get("min_p", 0.0) if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=defaults.get("repetition_penalty", 1.0) if body.repetition_penalty is None
        else body.repetition_penalty,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        priority=body.priority,
        structured_outputs=structured_outputs,
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
    )


def truncated_prompt(body: SamplingFields, token_ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens (``truncation_side`` "right": its first N);
    -1 keeps as many as leave room for one generated token. The whole prompt without the field."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len - 1
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens=0 would leave no prompt; send a positive number of tokens, or "
                            "-1 for as many as the context holds", param="truncate_prompt_tokens")
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if body.truncation_side == "right" else token_ids[len(token_ids) - keep:]


def response_id(prefix: str, body: Any) -> str:
    """A response's id: the route's prefix and the request's own ``request_id`` (vLLM's field), or a new one;
    a request that names its id is logged with it."""
    given = getattr(body, "request_id", None)
    if given is None:
        return new_id(prefix)
    logger.info("request %s-%s received", prefix, given)
    return f"{prefix}-{given}"


def token_text(decoded: Optional[str], token_id: int, as_token_ids: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:<id>`` with ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}" if as_token_ids else (decoded or "")


def prompt_logprobs_json(prompt_token_ids: list[int], entries: Optional[PromptLogprobs],
                         num_top: int) -> Optional[list[Optional[dict]]]:
    """vLLM's ``prompt_logprobs`` field: per prompt token (the first has none, it has no context) the
    ``num_top`` most likely tokens and the prompt's own, as ``{token id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    result: list[Optional[dict]] = []
    for token_id, entry in zip(prompt_token_ids, entries):
        if entry is None:
            result.append(None)
            continue
        kept = dict(sorted(entry.items(), key=lambda item: item[1].rank or 0)[:num_top])
        kept.setdefault(token_id, entry[token_id])
        result.append({str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                       for t, lp in kept.items()})
    return result


def finish_reason(c) -> Optional[str]:
    """OpenAI's finish reasons; aborted or failed sequences never reach a client as finished."""
    return c.finish_reason if c.finish_reason in ("stop", "length") else None


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
    """The OpenAI usage object; ``cached_tokens`` counts prompt tokens served from the prefix cache."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion, "prompt_tokens_details": {"cached_tokens": num_cached}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(exc: BaseException) -> str:
    err = to_api_error(exc)
    return sse(error_body(err.status, err.message, err.param, err.code))


SSE_DONE = "data: [DONE]\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def beam_search_params(ctx: "ServingContext", body: Any, max_tokens: int,
                       refused: Any) -> "BeamSearchParams":
    """vLLM's ``use_beam_search`` request as beam search settings: ``n`` is the beam width; ``refused`` lists
    (given, field) of what the request may not combine with it (a 400 naming the field)."""
    from pagoda.engine.beam_search import check_beam_width
    from pagoda.sampling_params import BeamSearchParams

    for given, field in refused:
        if given:
            raise APIError(400, f"use_beam_search does not take {field}: send the request without it, or without "
                                "use_beam_search", param=field)
    check_beam_width(body.n, ctx.engine.engine.config.model.max_logprobs, "n", "--max-logprobs")
    return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=bool(body.ignore_eos),
                            temperature=body.temperature or 0.0,
                            length_penalty=1.0 if body.length_penalty is None else body.length_penalty)


async def unless_disconnected(request: Request, coro) -> Any:
    """Run ``coro``; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone()
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


def output_error(out: RequestOutput) -> Optional[APIError]:
    """An engine-side failure of one request (e.g. the cache could not hold it) as a 500."""
    if out.error:
        return APIError(500, f"the engine could not finish the request: {out.error}", code="engine_error")
    return None
