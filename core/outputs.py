"""What the engine returns for each request, and how it is built: the sequences' text (incremental
detokenization), logprobs and metrics, one RequestOutput per user request (its ``n`` sequences)."""

from __future__ import annotations

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


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request."""

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
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` outputs so far."""

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


# prompt tokens decoded along with the output so the first output token gets its leading space right
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text a token at a time.

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

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back what could still become a stop string."""
        if finished or self.max_stop_len <= 1 or self.params.include_stop_str_in_output:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]


@dataclass
class SequenceGroup:
    """A user request and the sequences (``n`` of them) generated for it."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[Sequence]
    arrival_time: float


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, SequenceGroup] = {}
        self.sequence_ids: set[str] = set()  # ids of every live sequence (the n children)

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            children: list[Sequence]) -> None:
        """Track a request; raises InvalidRequestError if its id or a sequence id is already in use."""
        taken = [i for i in [request_id] + [c.request_id for c in children] if self.has(i)]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r} is already in use; pass a unique request id")
        for child in children:
            # the sequence feeds it as tokens are committed (and finds stop strings there)
            if child.sampling_params.detokenize:
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params)
        self.parents[request_id] = SequenceGroup(request_id, prompt, prompt_token_ids, children,
                                               children[0].arrival_time)
        self.sequence_ids.update(c.request_id for c in children)

    def has(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.sequence_ids

    def _forget(self, parent: SequenceGroup) -> None:
        del self.parents[parent.request_id]
        self.sequence_ids.difference_update(c.request_id for c in parent.children)

    def make_outputs(self, requests: list[Sequence]) -> list[RequestOutput]:
        """One RequestOutput per parent of ``requests``; finished parents are forgotten."""
        touched: dict[str, SequenceGroup] = {}
        for req in requests:
            parent = self.parents.get(req.parent_id or req.request_id)
            if parent is not None:
                touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            out = self._make_output(parent)
            outputs.append(out)
            if out.finished:
                self._forget(parent)
        return outputs

    def _make_output(self, parent: SequenceGroup) -> RequestOutput:
        completions = []
        for i, req in enumerate(parent.children):
            detok = req.detokenizer
            finished = req.is_finished
            logprobs = cumulative = None
            if req.logprobs is not None:
                logprobs = [self._to_logprobs(d) for d in req.logprobs]
                cumulative = sum(d[t][0] for d, t in zip(req.logprobs, req.output_token_ids))
            completions.append(CompletionOutput(
                index=i,
                text=detok.visible_text(finished) if detok is not None else "",
                token_ids=list(req.output_token_ids),
                cumulative_logprob=cumulative,
                logprobs=logprobs,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
            ))
        first = parent.children[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None if d is None else self._to_logprobs(d) for d in first.prompt_logprobs]
        errors = [c.error for c in parent.children if c.error]
        first_token_times = [c.first_token_time for c in parent.children if c.first_token_time is not None]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=all(c.is_finished for c in parent.children),
            prompt_logprobs=prompt_logprobs,
            metrics=RequestMetrics(
                arrival_time=parent.arrival_time,
                first_scheduled_time=first.scheduled_time,
                first_token_time=min(first_token_times) if first_token_times else None,
                finished_time=max((c.last_token_time or 0.0) for c in parent.children) or None,
                num_cached_tokens=first.num_cached_tokens,
            ),
            error=errors[0] if errors else None,
            num_cached_tokens=first.num_cached_tokens,
        )

    def _to_logprobs(self, d: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, (lp, rank) in d.items()}

    def abort(self, request_id: str) -> None:
        parent = self.parents.get(request_id)
        if parent is not None:
            self._forget(parent)
