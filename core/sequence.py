"""A sequence being generated: the unit the scheduler, the KV allocator and the runner work on.

A user request (``n`` completions of one prompt) is a
:class:`pagoda.outputs.SequenceGroup` of ``n`` sequences; with ``n = 1`` the
sequence carries the request's id. Plain Python, no tensors. The stop
conditions (EOS, stop token ids, stop strings, ``max_tokens``,
``min_tokens``, ``max_model_len``) are decided here and nowhere else.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.execution.lora_request import LoRARequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


# a tuple, not a set: membership compares by identity, without Enum's Python-level __hash__
FINISHED_STATUSES = (
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
)


@dataclass(eq=False)
class Sequence:
    """One sequence being generated.

    ``all_token_ids`` is the prompt followed by the output so far;
    ``num_computed_tokens`` counts the leading tokens whose K/V are in the
    cache. The scheduler is its one writer: it commits a step's progress in
    ``update`` from the runner's result (and resets it on preemption).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: Optional[str] = None
    priority: int = 0
    parent_id: Optional[str] = None
    seed: Optional[int] = None
    # who sent it, as the server identifies clients (the ``fair`` policy shares the engine between tenants)
    tenant: Optional[str] = None
    # the LoRA adapter the sequence runs with (None: the base model)
    lora_request: Optional[LoRARequest] = None
    # the model's other tokens that end a sequence as EOS does (generation_config.json lists several for chat
    # models whose turns end with a token of their own: Llama 3's <|eot_id|>, Gemma's <end_of_turn>)
    more_eos_token_ids: tuple[int, ...] = ()

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: Any = None
    error: Optional[str] = None
    # logprobs: one entry per output token, {token_id: (logprob, rank)}
    logprobs: Optional[list[dict[int, tuple[float, int]]]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, tuple[float, int]]]]] = None
    # timestamps for metrics (monotonic seconds); queued: when the engine took the request in (add_request), which
    # a served request reaches after the step that was running when it arrived
    queued_time: float = field(default_factory=time.monotonic)
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # opaque state a sampler may keep (e.g. a torch.Generator for seeded requests)
    sampler_state: Any = None
    # follows the text to find stop strings (pagoda.outputs.IncrementalDetokenizer); None without stop
    # strings. Its text is the one users see (the output side takes it rather than decoding again); without
    # stop strings the output side makes the text from the tokens
    detokenizer: Any = None
    # structured outputs: the sequence's place in its grammar (a pagoda.interfaces.StructuredOutputMatcher), set
    # by the engine before the sequence is scheduled and advanced here with every token appended; None without
    grammar: Any = None
    # the token ids of the request's bad_words (each as written alone and after a space), set by the engine
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def is_eos(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of the model's end-of-sequence tokens."""
        return token_id == self.eos_token_id or token_id in self.more_eos_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    # ---- stop conditions: decided here and nowhere else --------------------------

    def may_stop_at(self, num_output_tokens: int) -> bool:
        """Whether output token number ``num_output_tokens`` (1-based) may end the sequence by a stop
        condition (EOS, a stop token id, a stop string): only past ``min_tokens``."""
        return num_output_tokens > self.sampling_params.min_tokens

    def banned_token_ids(self) -> list[int]:
        """Tokens the next sample must not be: while a stop is not yet allowed, EOS and the stop token ids; the
        last token of each bad word whose earlier tokens end the output."""
        params = self.sampling_params
        banned = self._bad_word_endings() if self.bad_words_token_ids else []
        if self.may_stop_at(self.num_output_tokens + 1):
            return banned
        banned += params.stop_token_ids
        if self.eos_token_id is not None and not params.ignore_eos:
            banned.append(self.eos_token_id)
            banned += self.more_eos_token_ids
        return banned

    def _bad_word_endings(self) -> list[int]:
        output = self.output_token_ids
        return [word[-1] for word in self.bad_words_token_ids
                if len(word) == 1 or (len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1])]

    def may_speculate(self) -> bool:
        """Whether drafts verified by rejection sampling reproduce the plain sampler's distribution now.

        Penalties depend on every earlier output token (drafts included), a ban on stop tokens changes
        the distribution, and per-token logprobs come from the plain sampler: such requests decode one
        token per step.
        """
        params = self.sampling_params
        return not (params.has_penalties or params.logprobs is not None or params.allowed_token_ids is not None
                    or self.bad_words_token_ids or self.banned_token_ids())

    @property
    def is_prefill_only(self) -> bool:
        """``max_tokens=0``: the sequence ends once its prompt is computed, without a token."""
        return self.sampling_params.max_tokens == 0

    def append_output_tokens(self, token_ids: list[int], max_model_len: int) -> Optional[SequenceStatus]:
        """Append a step's tokens (one, or a verified speculative run) and apply every stop condition.

        Returns the finished status if the sequence ended; tokens after the one that ended it are
        dropped. Only a sequence with stop strings has a detokenizer here: it follows the text token by
        token to find them. A prefill-only sequence (``max_tokens=0``) appends nothing: the token sampled
        after its prompt is dropped and it ends with ``FINISHED_LENGTH``.
        """
        if self.sampling_params.max_tokens == 0:
            return SequenceStatus.FINISHED_LENGTH
        if self.grammar is not None:
            return self._append_under_grammar(token_ids, max_model_len)
        return self._append(token_ids, max_model_len)

    def _append(self, token_ids: list[int], max_model_len: int) -> Optional[SequenceStatus]:
        detok = self.detokenizer
        if detok is None and len(token_ids) == 1:
            # the common step, one token and no stop strings: the loop below without its bookkeeping
            token_id = token_ids[0]
            self.output_token_ids.append(token_id)
            self.all_token_ids.append(token_id)
            return self._stop_after(token_id, max_model_len)
        output_token_ids, all_token_ids = self.output_token_ids, self.all_token_ids
        status = None
        for token_id in token_ids:
            output_token_ids.append(token_id)
            all_token_ids.append(token_id)
            status = self._stop_after(token_id, max_model_len)
            if detok is not None:
                # the text follows every token kept (the output side shows it); a stop string is looked for
                # only while no other condition has ended the sequence
                stop = detok.add_tokens([token_id], status is None and self.may_stop_at(self.num_output_tokens))
                if stop is not None:
                    self.stop_reason = stop
                    status = SequenceStatus.FINISHED_STOPPED
            if status is not None:
                break
        return status

    def _append_under_grammar(self, token_ids: list[int], max_model_len: int) -> Optional[SequenceStatus]:
        """:meth:`append_output_tokens` for a sequence with a grammar: each token advances the matcher, and the
        sequence stops once the grammar is complete with nothing but its end left to follow."""
        grammar, status = self.grammar, None
        for token_id in token_ids:
            is_end = self.is_eos(token_id) and not self.sampling_params.ignore_eos
            if not (is_end and grammar.may_end()) and not grammar.accept_tokens([token_id]):
                if grammar.may_end():
                    # the grammar allowed nothing but its end, and the end was banned (min_tokens or a stop
                    # token id not yet allowed): the grammar is the hard constraint, so the output ends here
                    return SequenceStatus.FINISHED_STOPPED
                self.output_token_ids.append(token_id)
                self.all_token_ids.append(token_id)
                self.error = (f"token {token_id} does not fit the structured output's grammar after "
                              f"{self.num_output_tokens - 1} output tokens (the grammar allowed no token here that "
                              "the other sampling parameters allow, e.g. min_tokens banning the end)")
                return SequenceStatus.FINISHED_ERROR
            status = self._append([token_id], max_model_len)
            if status is None and grammar.is_terminated():
                status = SequenceStatus.FINISHED_STOPPED
            if status is not None:
                return status
        return status

    def _stop_after(self, token_id: int, max_model_len: int) -> Optional[SequenceStatus]:
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        is_eos = self.is_eos(token_id) and not params.ignore_eos
        # the token is asked about first: most are no stop token, and then min_tokens does not matter
        if (is_eos or token_id in params.stop_token_ids) and self.may_stop_at(num_output):
            if not is_eos:
                self.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if len(self.all_token_ids) >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    @property
    def finish_reason(self) -> Optional[str]:
        if self.status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                           SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR):
            return self.status.value
        return None
