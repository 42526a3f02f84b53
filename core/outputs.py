"""What the engine returns for each request, and how it is built.

A step produces deltas. The engine side (:class:`RequestTracker`) turns a step's progress into one
:class:`EngineOutput` per touched request: each sequence's new token ids and raw logprobs, and no text,
except for a sequence with stop strings, whose text the engine follows to find them: its new text comes
along, so it is decoded once. The output side (:class:`OutputProcessor`, one :class:`RequestState` per
request) turns those into :class:`RequestOutput`s: it detokenizes the other sequences incrementally and
decodes each logprob token once.
Both do work in proportion to what is new, so a request's outputs cost linear time in its length.
The two sides may run on different threads (the async engine runs the output side on the event loop).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence


@dataclass
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# one dict per position: token_id -> Logprob
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]
# as the sampler gives them: token_id -> (logprob, rank)
RawLogprobs = dict[int, tuple[float, int]]


class RequestOutputKind(enum.Enum):
    """What each :class:`RequestOutput` of a request holds."""

    CUMULATIVE = "cumulative"  # everything so far (its lists are copied each step: O(length) per step)
    DELTA = "delta"  # only what is new since the previous output of the request
    FINAL_ONLY = "final_only"  # one output, complete, when the request finishes


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request (with DELTA outputs: what is new of it)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request arrived, joined the engine's queue, was first scheduled, got its first token and finished
    (monotonic seconds)."""

    arrival_time: float
    queued_time: Optional[float] = None
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` outputs so far.

    With :attr:`RequestOutputKind.DELTA`, ``outputs`` holds only the sequences with something new (new
    tokens, new text, or their finish), each with only that news; ``prompt_logprobs`` comes once.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[PromptLogprobs] = None
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ---- beam search, offline (LLM.beam_search) ----------------------------------------------------------


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` the prompt's and its own, ``logprobs`` per token of its own the candidates it was
    chosen among, ``cum_logprob`` the sum of its own tokens' logprobs; ``text`` the decoded ``tokens`` (prompt
    included, as vLLM gives it)."""

    tokens: list[int]
    logprobs: list[dict[int, "Logprob"]]
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    @property
    def output_token_ids(self) -> list[int]:
        """The beam's own tokens (one logprobs entry each), without the prompt's."""
        return self.tokens[len(self.tokens) - len(self.logprobs):]


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


# ---- pooling models, offline (LLM.embed, LLM.score, LLM.encode) ------------------------------------


@dataclass
class PoolingOutput:
    """One input's pooled hidden state (``LLM.encode``): a vector, or a cross-encoder's score as a 0-d tensor."""

    data: Any


@dataclass
class EmbeddingOutput:
    """One input's embedding (``LLM.embed``): normalized where the model normalizes (its modules.json)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    """One text pair's score (``LLM.score``): a cross-encoder's, or the cosine of two embeddings."""

    score: float


@dataclass
class PoolingRequestOutput:
    """What a pooling call returns per input (or per pair): ``outputs`` is a :class:`PoolingOutput`,
    :class:`EmbeddingOutput` or :class:`ScoringOutput`."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s output per input."""


class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s output per pair (``prompt_token_ids``: the pair's, for a cross-encoder; both texts' for
    an embedding model)."""


# ---- the engine side: a step's new tokens, no text ---------------------------------------------------


@dataclass
class SequenceDelta:
    """What one step added to one sequence."""

    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list[RawLogprobs]]
    finish_reason: Optional[str]
    stop_reason: Any
    # a sequence whose text the engine follows (stop strings): its text is the first ``num_kept_chars`` of
    # the text sent before (cut at a stop string, it can shrink), then ``new_text``; None for the others
    new_text: Optional[str] = None
    num_kept_chars: int = 0


@dataclass
class EngineOutput:
    """What one step produced for one user request: each of its sequences' new tokens, no text."""

    request_id: str
    sequences: list[SequenceDelta]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[RawLogprobs]]] = None  # in the first output that has them all
    error: Optional[str] = None


@dataclass
class SequenceGroup:
    """A user request and the sequences (``n`` of them) generated for it."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[Sequence]
    arrival_time: float
    num_emitted: list[int] = field(default_factory=list)  # output tokens of each child already emitted
    num_emitted_chars: list[int] = field(default_factory=list)  # text of each child already emitted
    has_emitted_prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        self.num_emitted = [0] * len(self.children)
        self.num_emitted_chars = [0] * len(self.children)

    def take_output(self) -> EngineOutput:
        """The tokens each child gained since the last call: O(new tokens)."""
        deltas = []
        for i, seq in enumerate(self.children):
            start = self.num_emitted[i]
            end = seq.num_output_tokens
            new_logprobs = seq.logprobs[start:end] if seq.logprobs is not None else None
            delta = SequenceDelta(i, seq.output_token_ids[start:end], new_logprobs, seq.finish_reason,
                                  seq.stop_reason)
            if seq.detokenizer is not None:
                text = seq.detokenizer.text
                delta.num_kept_chars = min(self.num_emitted_chars[i], len(text))
                delta.new_text = text[delta.num_kept_chars:]
                self.num_emitted_chars[i] = len(text)
            deltas.append(delta)
            self.num_emitted[i] = end
        first = self.children[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None and not self.has_emitted_prompt_logprobs:
            # each child computes the whole prompt (none shares it): the first to finish gives them, so they come
            # no later than any child's first token
            for child in self.children:
                if len(child.prompt_logprobs) >= len(self.prompt_token_ids):
                    prompt_logprobs = list(child.prompt_logprobs)  # once; the reader may be on another thread
                    self.has_emitted_prompt_logprobs = True
                    break
        errors = [c.error for c in self.children if c.error]
        first_token_times = [c.first_token_time for c in self.children if c.first_token_time is not None]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            queued_time=first.queued_time,
            first_scheduled_time=first.scheduled_time,
            first_token_time=min(first_token_times) if first_token_times else None,
            finished_time=max((c.last_token_time or 0.0) for c in self.children) or None,
            num_cached_tokens=first.num_cached_tokens,
        )
        return EngineOutput(self.request_id, deltas, all(c.is_finished for c in self.children), metrics,
                            prompt_logprobs, errors[0] if errors else None)


class RequestTracker:
    """The engine's table of user requests and their sequences; emits each step's :class:`EngineOutput`s."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # the engine thread's: finds stop strings
        self.parents: dict[str, SequenceGroup] = {}
        self.sequence_ids: set[str] = set()  # ids of every live sequence (the n children)

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            children: list[Sequence]) -> None:
        """Track a request; raises InvalidRequestError if its id or a sequence id is already in use."""
        taken = [i for i in [request_id] + [c.request_id for c in children] if self.has(i)]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r} is already in use; pass a unique request id")
        for child in children:
            params = child.sampling_params
            if params.detokenize and params.stop_strings:
                # a stop string ends the sequence in the step that completes it, so the engine follows the
                # text of such sequences as tokens are committed, and sends it to the output side with them
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self.parents[request_id] = SequenceGroup(request_id, prompt, prompt_token_ids, children,
                                               children[0].arrival_time)
        self.sequence_ids.update(c.request_id for c in children)

    def has(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.sequence_ids

    def make_outputs(self, sequences: list[Sequence]) -> list[EngineOutput]:
        """One EngineOutput per parent of ``sequences``; finished parents are forgotten."""
        touched: dict[str, SequenceGroup] = {}
        for seq in sequences:
            parent = self.parents.get(seq.parent_id or seq.request_id)
            if parent is not None:
                touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            out = parent.take_output()
            outputs.append(out)
            if out.finished:
                self.forget(parent.request_id)
        return outputs

    def forget(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            self.sequence_ids.difference_update(c.request_id for c in parent.children)


# ---- the output side: text, decoded logprobs, RequestOutputs -----------------------------------------


# prompt tokens decoded along with the output so the first output token gets its leading space right
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text a token at a time: each call decodes only the
    tokens since the last complete piece of text, so the work is linear in the output's length.

    Text is only emitted once it no longer ends in an incomplete UTF-8
    character (U+FFFD). Stop strings are searched in the new text plus the
    tail that could start one.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""
        self.max_stop_len = max((len(s) for s in params.stop_strings), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        ) if ids else ""

    def add_tokens(self, token_ids: list[int], may_stop: bool) -> Optional[str]:
        """Append tokens; returns the stop string hit (text truncated at it), or None.

        ``may_stop``: whether a stop string may end the sequence now (the sequence decides, see
        :meth:`pagoda.sequence.Sequence.may_stop_at`); the text grows either way.
        """
        self.ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.params.stop_strings or not may_stop:
            return None
        best: Optional[tuple[int, str]] = None
        for stop in self.params.stop_strings:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        return stop

    def take_text(self, num_kept_chars: int, new_text: str) -> None:
        """Take the text another detokenizer of the same sequence made: the first ``num_kept_chars`` of this
        one's, then ``new_text`` (no decoding here)."""
        self.text = self.text[:num_kept_chars] + new_text

    def num_visible_chars(self, finished: bool) -> int:
        """How much of the text is safe to show: while running, hold back what could still become a stop
        string."""
        if finished or self.max_stop_len <= 1 or self.params.include_stop_str_in_output:
            return len(self.text)
        return max(0, len(self.text) - self.max_stop_len + 1)

    def visible_text(self, finished: bool) -> str:
        return self.text[:self.num_visible_chars(finished)]


class _SequenceState:
    """The output side of one sequence: its tokens, text and decoded logprobs so far, and how much of
    them the request's previous outputs held."""

    def __init__(self, index: int, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params) if params.detokenize else None
        self.token_ids: list[int] = []
        self.logprobs: Optional[SampleLogprobs] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.has_sent_finish = False

    def apply(self, delta: SequenceDelta, decode_logprobs: Any) -> None:
        new = delta.new_token_ids
        self.token_ids.extend(new)
        if delta.new_logprobs is not None and self.logprobs is not None:
            for token_id, entry in zip(new, delta.new_logprobs):
                self.logprobs.append(decode_logprobs(entry))
                self.cumulative_logprob += entry[token_id][0]
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        detok = self.detokenizer
        if detok is not None and delta.new_text is not None:
            detok.take_text(delta.num_kept_chars, delta.new_text)  # the engine decoded it, finding stop strings
            return
        if detok is None or not new:
            return
        # token by token, as the engine follows a text: a stop string (in outputs made elsewhere than by
        # RequestTracker) is found at the token that ended the sequence, and the text cut there
        ends_at_stop_string = delta.finish_reason == "stop" and isinstance(delta.stop_reason, str)
        last = len(new) - 1
        for i, token_id in enumerate(new):
            detok.add_tokens([token_id], ends_at_stop_string and i == last)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> str:
        detok = self.detokenizer
        return detok.visible_text(self.is_finished) if detok is not None else ""

    def cumulative(self, copy: bool) -> CompletionOutput:
        token_ids = list(self.token_ids) if copy else self.token_ids
        logprobs = self.logprobs
        if copy and logprobs is not None:
            logprobs = list(logprobs)
        return CompletionOutput(self.index, self.text(), token_ids, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)

    def take_delta(self) -> Optional[CompletionOutput]:
        """What is new since the previous call (tokens, text, logprobs), or None when nothing is."""
        num_tokens = len(self.token_ids)
        detok = self.detokenizer
        num_chars = detok.num_visible_chars(self.is_finished) if detok is not None else 0
        reports_finish = self.is_finished and not self.has_sent_finish
        if num_tokens == self.num_sent_tokens and num_chars == self.num_sent_chars and not reports_finish:
            return None
        start, self.num_sent_tokens = self.num_sent_tokens, num_tokens
        text = detok.text[self.num_sent_chars:num_chars] if detok is not None else ""
        self.num_sent_chars = num_chars
        self.has_sent_finish = self.is_finished
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        return CompletionOutput(self.index, text, self.token_ids[start:], self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)


class RequestState:
    """The output side of one user request: applies its :class:`EngineOutput`s and builds its
    :class:`RequestOutput`s of the kind asked for."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams,
                 kind: RequestOutputKind, tokenizer: Any, token_texts: dict[int, str]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.tokenizer = tokenizer
        self.token_texts = token_texts  # token id -> its text, shared by the requests of one processor
        self.sequences = [_SequenceState(i, tokenizer, prompt_token_ids, params) for i in range(params.n)]
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.has_sent_prompt_logprobs = False
        self.metrics: Optional[RequestMetrics] = None
        self.error: Optional[str] = None
        self.finished = False

    def token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _decode_logprobs(self, entry: RawLogprobs) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, self.token_text(t)) for t, (lp, rank) in entry.items()}

    def apply(self, out: EngineOutput) -> None:
        """Take in one step's news for the request: O(its new tokens)."""
        for delta in out.sequences:
            self.sequences[delta.index].apply(delta, self._decode_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None if d is None else self._decode_logprobs(d) for d in out.prompt_logprobs]
        self.metrics = out.metrics
        self.error = out.error or self.error
        self.finished = out.finished

    def make_output(self) -> Optional[RequestOutput]:
        """The request's output of its kind now; None when there is none to give (FINAL_ONLY while running,
        DELTA with nothing new)."""
        kind = self.kind
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            completions = [c for c in (s.take_delta() for s in self.sequences) if c is not None]
            if self.has_sent_prompt_logprobs:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self.has_sent_prompt_logprobs = True
            if not completions and prompt_logprobs is None and not self.finished:
                return None
        elif kind is RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            completions = [s.cumulative(copy=False) for s in self.sequences]
        else:
            completions = [s.cumulative(copy=True) for s in self.sequences]
        metrics = self.metrics
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
            error=self.error,
            num_cached_tokens=metrics.num_cached_tokens if metrics is not None else 0,
        )


class OutputProcessor:
    """The output side of many requests: :class:`EngineOutput`s in, :class:`RequestOutput`s out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # used on this processor's thread only
        self.token_texts: dict[int, str] = {}
        self.requests: dict[str, RequestState] = {}

    def new_state(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams,
                  kind: RequestOutputKind) -> RequestState:
        """A request's output state, not tracked here (for a caller that keeps its own)."""
        return RequestState(request_id, prompt, prompt_token_ids, params, kind, self.tokenizer, self.token_texts)

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams,
            kind: RequestOutputKind) -> None:
        self.requests[request_id] = self.new_state(request_id, prompt, prompt_token_ids, params, kind)

    def process(self, engine_outputs: list[EngineOutput]) -> list[RequestOutput]:
        """Apply a step's outputs; the RequestOutputs of the tracked requests that have one. Finished
        requests are forgotten."""
        outputs = []
        for eo in engine_outputs:
            state = self.requests.get(eo.request_id)
            if state is None:
                continue
            state.apply(eo)
            out = state.make_output()
            if out is not None:
                outputs.append(out)
            if eo.finished:
                del self.requests[eo.request_id]
        return outputs

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
