"""Beam search as vLLM runs it, over pagoda's engine: each step extends every live beam by its ``2 x beam_width``
likeliest next tokens (one one-token request per beam, all beams of a step in the engine at once, their shared
prefixes found in the prefix cache) and keeps the ``beam_width`` candidates of highest score. :class:`BeamSearch`
holds one prompt's beams; ``LLM.beam_search`` drives it offline and :func:`beam_search_async` on a server."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from pagoda.errors import InvalidRequestError
from pagoda.outputs import BeamSearchSequence, RequestOutput, RequestOutputKind
from pagoda.sampling_params import BeamSearchParams, SamplingParams


def check_beam_width(width: int, max_logprobs: int, name: str, limit_name: str) -> None:
    """Refuse a beam width whose ``2 x width`` candidates per step are more logprobs than the engine gives
    (``name``: the caller's name for the width, ``limit_name`` for the limit)."""
    if 2 * width > max_logprobs:
        raise InvalidRequestError(f"{name}={width} needs {2 * width} logprobs per step, more than this engine's "
                                  f"{limit_name} ({max_logprobs}); use {name} <= {max_logprobs // 2}", param=name)


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam's one-token request asks for: its ``2 x beam_width`` likeliest tokens' logprobs."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)


class BeamSearch:
    """One prompt's beams: the live ones (the first: the prompt alone, whose tokens its first step gives) and the
    finished ones."""

    def __init__(self, params: BeamSearchParams, eos_token_id: Optional[int]) -> None:
        self.params = params
        self.eos = eos_token_id
        self.live: list[BeamSearchSequence] = [BeamSearchSequence([], [])]
        self.done: list[BeamSearchSequence] = []

    def score(self, beam: BeamSearchSequence) -> float:
        """The cumulative logprob over ``len(tokens) ** length_penalty``, the prompt's tokens counted and an
        end-of-sequence token not (vLLM's score)."""
        length = len(beam.tokens) - (1 if self.eos is not None and beam.tokens[-1] == self.eos else 0)
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def inputs(self, prompt: Any) -> list[Any]:
        """This step's input per live beam: ``prompt`` for the first step, else the beam's tokens."""
        return [prompt if not beam.tokens else {"prompt_token_ids": beam.tokens} for beam in self.live]

    def advance(self, outputs: list[RequestOutput]) -> None:
        """Take the step's output of each live beam (in :meth:`inputs`' order): every candidate token extends its
        beam; those ending in the end-of-sequence token finish (unless ``ignore_eos``), the best others live."""
        candidates = []
        for beam, out in zip(self.live, outputs):
            tokens = beam.tokens or list(out.prompt_token_ids)
            top = out.outputs[0].logprobs[0]
            for token, logprob in top.items():
                child = BeamSearchSequence(tokens + [token], beam.logprobs + [top], beam.cum_logprob + logprob.logprob)
                if token == self.eos and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    self.done.append(child)
                else:
                    candidates.append(child)
        self.live = sorted(candidates, key=self.score, reverse=True)[:self.params.beam_width]

    def best(self, decode: Any, skip_prompt: bool = False) -> list[BeamSearchSequence]:
        """The ``beam_width`` best of the finished and live beams, best first, their text decoded (the prompt's
        tokens included, as vLLM's offline beams have it, or not with ``skip_prompt``)."""
        for beam in self.live:
            beam.finish_reason = "length"
        best = sorted(self.done + self.live, key=self.score, reverse=True)[:self.params.beam_width]
        for beam in best:
            beam.text = decode(beam.output_token_ids if skip_prompt else beam.tokens)
        return best


async def beam_search_async(engine: Any, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                            tenant: Optional[str] = None, lora_request: Any = None) -> list[BeamSearchSequence]:
    """One prompt's beam search on an ``AsyncLLMEngine``: each step's beams as one-token requests at once,
    awaited together (cancelling this cancels them). Returns the best beams, their text the generated part."""
    search = BeamSearch(params, engine.engine.eos_token_id)
    sampling = step_params(params)
    engine.check_capacity(params.beam_width, len(prompt_token_ids) + params.max_tokens, tenant)

    async def last(stream: Any) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    for n in range(params.max_tokens):
        if not search.live:
            break
        streams = [engine.generate(f"{request_id}-beam{n}-{k}", prompt, sampling, check_capacity=False,
                                   output_kind=RequestOutputKind.FINAL_ONLY, tenant=tenant, lora_request=lora_request)
                   for k, prompt in enumerate(search.inputs({"prompt_token_ids": prompt_token_ids}))]
        search.advance(await asyncio.gather(*(last(s) for s in streams)))
    return search.best(engine.engine.tokenizer.decode, skip_prompt=True)
