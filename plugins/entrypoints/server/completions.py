"""``POST /v1/completions``: text in, text out, streamed as SSE chunks or returned whole.

With ``echo`` the prompt's text comes before the completion's; with ``logprobs`` as well, the prompt tokens'
logprobs come before the completion's (the first prompt token has none: ``null``), which is how evaluation
harnesses score a text: ``max_tokens: 0, echo: true, logprobs: 1`` computes the prompt alone. With vLLM's
``use_beam_search`` the ``n`` choices of a prompt are its best beams.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.engine.beam_search import beam_search_async
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.protocol import CompletionRequest
from pagoda.plugins.entrypoints.server.serving import (ServingContext, StreamUsage, beam_search_params, finish_reason,
                                                       make_sampling_params, now_s, output_error, prompt_logprobs_json,
                                                       response_id, token_text, truncated_prompt, unless_disconnected,
                                                       usage)
from pagoda.plugins.entrypoints.server.streaming import Generation, stream_sse
from pagoda.plugins.entrypoints.server.structured import check_compiles, structured_outputs_of
from pagoda.plugins.entrypoints.server.timeline import mark, note_started


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request):
    mark(request, "parsed")
    lora = ctx.resolve_model(body.model)
    if body.prompt_embeds is not None:
        raise APIError(400, "prompt_embeds is not served: pagoda takes prompts as text or token ids; send prompt",
                       param="prompt_embeds")
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server; put the text in the prompt", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of={body.best_of} must equal n={body.n}; ranking extra sequences is not supported",
                       param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not available with stream=true; send the request without streaming, "
                            "or stream with echo=true and logprobs, whose first chunk carries the prompt's logprobs",
                       param="prompt_logprobs")
    # the number of top logprobs each prompt position needs: for echo with logprobs, for prompt_logprobs
    echoes_logprobs = body.echo and body.logprobs is not None
    wanted = [n for n in (body.logprobs if echoes_logprobs else None, body.prompt_logprobs) if n is not None]
    num_prompt_top = max(wanted) if wanted else None

    raw = body.prompt
    prompts = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else list(raw)
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        ctx.check_text_length(text, "prompt")
    ctx.check_request_chars([len(text) for text in texts], "prompt", "prompts")
    for p in prompts:
        if not isinstance(p, str):  # a token prompt too long for the context: refused before it is decoded
            ctx.resolve_max_tokens(len(truncated_prompt(body, p, ctx.max_model_len)), body.max_tokens)

    def tokenize(tok, p):
        """One prompt, as one turn of the tokenizer thread: its token ids and text; its first token's text when
        the prompt's logprobs are echoed."""
        if isinstance(p, str):
            ids, text = tok.encode(p, add_special_tokens=body.add_special_tokens), p
        else:
            ids, text = list(p), tok.decode(p) if body.echo and all(0 <= t < len(tok) for t in p) else None
        kept = truncated_prompt(body, ids, ctx.max_model_len)
        if len(kept) < len(ids):  # the echoed text is what the model saw
            ids, text = kept, tok.decode(kept) if body.echo and all(0 <= t < len(tok) for t in kept) else None
        first_text = tok.decode(ids[:1]) if echoes_logprobs and text is not None else ""
        return {"prompt": text, "prompt_token_ids": ids}, first_text

    tokenized = ctx.tokenizer_turns.run_now(tokenize, prompts, sum(len(p) for p in prompts))
    if tokenized is None:
        tokenized = await unless_disconnected(request, ctx.run_tokenizer_each(tokenize, prompts))
    mark(request, "tokenized")
    engine_prompts, first_texts = [p for p, _ in tokenized], [t for _, t in tokenized]
    max_tokens = min(ctx.resolve_max_tokens(len(p["prompt_token_ids"]), body.max_tokens) for p in engine_prompts)
    structured_outputs, field = structured_outputs_of(body)
    await check_compiles(ctx.engine, structured_outputs, field, request, ctx.tenant_of(request, body))
    if body.use_beam_search:
        return await _beam_search_completion(ctx, body, request, engine_prompts, max_tokens, structured_outputs,
                                             lora)
    params = make_sampling_params(body, max_tokens, body.logprobs, num_prompt_top, structured_outputs,
                                  ctx.sampling_defaults)
    request_id = response_id("cmpl", body)
    as_ids = ctx.tokens_as_token_ids(body)
    gen = Generation(ctx.engine, request_id, engine_prompts, params, body.priority, stream=body.stream,
                     tenant=ctx.tenant_of(request, body), lora_request=lora, request_log=ctx.request_log)
    await unless_disconnected(request, gen.start())
    note_started(request, request_id, gen, body.stream)
    echo = [_Echo(p["prompt"] or "", first_texts[i], body.logprobs if echoes_logprobs else None)
            for i, p in enumerate(engine_prompts)] if body.echo else None
    if body.stream:
        return StreamingResponse(_stream(ctx, gen, request_id, body.n, echo, ctx.stream_usage(body),
                                         ctx.model_name(lora), bool(body.return_token_ids), as_ids),
                                 media_type="text/event-stream")
    outputs = await unless_disconnected(request, gen.final())
    choices, num_prompt, num_completion, num_cached = [], 0, 0, 0
    for i, out in enumerate(outputs):
        err = output_error(out)
        if err is not None:
            raise err
        num_prompt += len(out.prompt_token_ids)
        num_cached += out.num_cached_tokens
        for c in out.outputs:
            num_completion += len(c.token_ids)
            choice = {"index": i * body.n + c.index, "text": (echo[i].text if echo else "") + c.text,
                      "logprobs": _choice_logprobs(c, echo[i] if echo else None, out, 0, as_token_ids=as_ids),
                      "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice.update(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(c.token_ids))
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                                 body.prompt_logprobs)
            choices.append(choice)
    return JSONResponse({"id": request_id, "object": "text_completion", "created": now_s(),
                         "model": ctx.model_name(lora), "choices": choices,
                         "usage": usage(num_prompt, num_completion, num_cached)})


async def _beam_search_completion(ctx: ServingContext, body: CompletionRequest, request: Request,
                                  engine_prompts: list[dict], max_tokens: int, structured_outputs: Any, lora: Any):
    """``use_beam_search``: each prompt's ``n`` best beams (vLLM's ``n`` is the beam width) as its choices, best
    first, found as ``LLM.beam_search`` finds them (``length_penalty``, ``ignore_eos`` and ``temperature`` apply)."""
    params = beam_search_params(ctx, body, max_tokens, (
        (body.stream, "stream"), (structured_outputs is not None, "structured_outputs"), (body.echo, "echo"),
        (body.logprobs is not None, "logprobs"), (body.prompt_logprobs is not None, "prompt_logprobs")))
    request_id = response_id("cmpl", body)
    tenant = ctx.tenant_of(request, body)
    results = await unless_disconnected(request, asyncio.gather(*(
        beam_search_async(ctx.engine, f"{request_id}-{i}", p["prompt_token_ids"], params, tenant, lora)
        for i, p in enumerate(engine_prompts))))
    choices, num_prompt, num_completion = [], 0, 0
    for i, (prompt, beams) in enumerate(zip(engine_prompts, results)):
        num_prompt += len(prompt["prompt_token_ids"])
        for j, beam in enumerate(beams):
            generated = beam.output_token_ids
            num_completion += len(generated)
            choice = {"index": i * body.n + j, "text": beam.text, "logprobs": None,
                      "finish_reason": beam.finish_reason, "stop_reason": None}
            if body.return_token_ids:
                choice.update(prompt_token_ids=list(prompt["prompt_token_ids"]), token_ids=generated)
            choices.append(choice)
    return JSONResponse({"id": request_id, "object": "text_completion", "created": now_s(),
                         "model": ctx.model_name(lora), "choices": choices,
                         "usage": usage(num_prompt, num_completion, 0)})


@dataclass(frozen=True)
class _Echo:
    """What a choice of one prompt echoes: the prompt's text and, with ``num_top`` set, its logprobs."""

    text: str
    first_token_text: str  # the first prompt token has no logprob entry to carry its text
    num_top: Optional[int]


def _choice_logprobs(c: CompletionOutput, echo: Optional[_Echo], out: RequestOutput, text_offset: int,
                     prompt_logprobs: Optional[PromptLogprobs] = None, as_token_ids: bool = False) -> Optional[dict]:
    """The logprobs of a choice's new tokens (None without logprobs); the prompt's first when it echoes them
    (``prompt_logprobs``: the request's, when ``out`` no longer carries them; ``as_token_ids``: tokens named
    ``token_id:<id>``)."""
    if c.logprobs is None:
        return None
    if echo is None:
        return _logprobs(c, text_offset, as_token_ids)
    if echo.num_top is None:
        return _logprobs(c, text_offset + len(echo.text), as_token_ids)
    entries = out.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
    prompt_part = _prompt_logprobs(out.prompt_token_ids, entries, echo.first_token_text, echo.num_top)
    completion_part = _logprobs(c, len(echo.text), as_token_ids)
    return {key: prompt_part[key] + completion_part[key] for key in prompt_part}


def _stream(ctx: ServingContext, gen: Generation, request_id: str, n: int, echo: Optional[list[_Echo]],
            stream_usage: StreamUsage, model: str, return_token_ids: bool = False,
            as_token_ids: bool = False) -> AsyncIterator[str]:
    """The SSE body: each choice's new text (after the echoed prompt and its logprobs, with its first one)."""
    head = {"id": request_id, "object": "text_completion", "created": now_s(), "model": model}
    sent_chars: dict[int, int] = {}  # choice index -> characters of text sent (the echoed prompt's included)
    prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt index -> its logprobs (they arrive once)

    def choices(i: int, out: RequestOutput) -> list[dict]:
        if out.prompt_logprobs is not None:
            prompt_logprobs[i] = out.prompt_logprobs
        result = []
        for c in out.outputs:
            idx = i * n + c.index
            first = idx not in sent_chars
            echoed = echo[i] if echo and first else None
            text = (echoed.text if echoed else "") + c.text
            # (new tokens whose text is held back still go out when their logprobs or ids were asked for)
            has_new_tokens = (c.logprobs is not None or return_token_ids) and bool(c.token_ids)
            if not first and not text and not has_new_tokens and c.finish_reason is None:
                continue
            start_chars = sent_chars.get(idx, 0)
            choice = {"index": idx, "text": text,
                      "logprobs": _choice_logprobs(c, echoed, out, start_chars, prompt_logprobs.get(i), as_token_ids),
                      "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
            if return_token_ids:  # the prompt's ids with a choice's first chunk, then each chunk's new ids
                if first:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
            result.append(choice)
            sent_chars[idx] = start_chars + len(text)
        return result

    return stream_sse(gen, head, choices, stream_usage)


def _prompt_logprobs(token_ids: list[int], entries: Optional[PromptLogprobs], first_token_text: str,
                     num_top: int) -> dict:
    """The legacy logprobs object of the prompt's tokens: the first has no logprob (``null``), each other has
    its own and the ``num_top`` most likely at its position."""
    if entries is None:  # the engine always computes them for such a request
        raise APIError(500, "the engine returned no prompt logprobs for a request with echo and logprobs",
                       code="engine_error")
    tokens, token_logprobs, top, offsets = [first_token_text], [None], [None], [0]
    offset = len(first_token_text)
    for token_id, entry in zip(token_ids[1:], entries[1:]):
        own: Logprob = entry[token_id]
        text = own.decoded_token or ""
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num_top]
        top_entry = {lp.decoded_token or "": lp.logprob for lp in ranked}
        top_entry.setdefault(text, own.logprob)
        tokens.append(text)
        token_logprobs.append(own.logprob)
        top.append(top_entry)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _logprobs(c: CompletionOutput, text_offset: int, as_token_ids: bool = False) -> dict:
    """The legacy completions logprobs object for a choice's (new) tokens (``as_token_ids``: each token named
    ``token_id:<id>``, vLLM's ``return_tokens_as_token_ids``; text offsets still count the text)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(c.token_ids, c.logprobs):
        chosen: Logprob = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(token_text(text, token_id, as_token_ids))
        token_logprobs.append(chosen.logprob)
        top.append({token_text(lp.decoded_token, t, as_token_ids): lp.logprob
                    for t, lp in sorted(entry.items(), key=lambda item: item[1].rank or 0)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
