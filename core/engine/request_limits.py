"""The rules a request must meet to be queued, written once.

:meth:`LLMEngine.add_request <pagoda.engine.llm_engine.LLMEngine.add_request>` applies :meth:`RequestLimits.check`
to every request; ``pagoda simulate`` applies the same check and records a request that fails it as failed;
the OpenAI server applies :meth:`RequestLimits.fit_max_tokens` first (it reserves a request's whole output up
front) and answers an :class:`~pagoda.errors.InvalidRequestError` with a 400 carrying its message and ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams


# A request without max_tokens may generate this many tokens at most (or what the context leaves, if less):
# enough for nearly any answer, while a model that loops on a request without a bound holds a batch slot for
# 2,048 steps, not for the rest of an 8,192-token context. A server's ``--default-max-tokens 0`` gives it
# all the context leaves instead (vLLM's choice).
DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class RequestLimits:
    """One engine's limits: its context length, its vocabulary and its KV cache."""

    max_model_len: int
    vocab_size: int
    num_blocks: int  # KV blocks in the whole cache
    blocks_needed: Callable[[int], int]  # the KV allocator's: blocks that hold that many tokens
    max_logprobs: int = MAX_LOGPROBS  # per token, for logprobs and prompt_logprobs (--max-logprobs)

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` if the request can never run: an empty prompt, one that leaves no
        room in the context for a generated token, a token id outside the vocabulary (in the prompt, the stop
        ids or the logit bias), more logprobs per token than ``max_logprobs``, a prompt (plus its first generated
        token) larger than the whole KV cache."""
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is not None and asked > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name} asks for {asked} logprobs per token, more than this server's limit of "
                    f"{self.max_logprobs} (--max-logprobs); ask for at most {self.max_logprobs}", param=name)
        num_prompt_tokens = len(prompt_token_ids)
        if not num_prompt_tokens:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        self._check_context_room(num_prompt_tokens)
        vocab = self.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # min/max: no Python loop when all fit
            bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                      param="prompt")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            out_of_vocab = [t for t in ids if t >= vocab]
            if out_of_vocab:
                raise InvalidRequestError(f"{name} has token ids {out_of_vocab[:5]} outside the vocabulary "
                                          f"[0, {vocab})", param=name)
        need = self.blocks_needed(num_prompt_tokens + 1)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {need} KV blocks but the cache holds {self.num_blocks}; raise "
                "--kv-cache-memory-bytes or shorten the prompt", param="prompt")

    def fit_max_tokens(self, num_prompt_tokens: int, max_tokens: Optional[int], param: str = "max_tokens",
                       default: Optional[int] = None) -> int:
        """The output budget of a request that reserves its whole output up front (OpenAI's contract): the
        ``max_tokens`` asked for (``param`` names the field it came in), or when None ``default`` cut to what
        the context leaves (None: all it leaves). Raises :class:`InvalidRequestError` when the prompt leaves no
        room, or the prompt plus ``max_tokens`` exceeds the context or the whole KV cache. The request must
        still pass :meth:`check`."""
        room = self._check_context_room(num_prompt_tokens)
        if max_tokens is None:
            max_tokens = room if default is None else min(default, room)
        if max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion); lower {param} to at most {room}", param=param)
        need = self.blocks_needed(num_prompt_tokens + max_tokens)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"the prompt plus {param} needs {need} KV cache blocks but the server has {self.num_blocks}; "
                f"lower {param} or shorten the prompt", param=param)
        return max_tokens

    def _check_context_room(self, num_prompt_tokens: int) -> int:
        """Tokens the context leaves after the prompt; at least one must be left to generate."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens; shorten the prompt to at most {self.max_model_len - 1} tokens",
                param="prompt")
        return room
