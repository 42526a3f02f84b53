"""Builds RequestOutputs from request state: the text, logprobs and metrics of the n sequences of a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagoda.detokenizer import IncrementalDetokenizer
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.request import Request


@dataclass
class ParentState:
    """A user request and the sequences (``n`` of them) generated for it."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.sequence_ids: set[str] = set()  # ids of every live sequence (the n children)

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], children: list[Request]) -> None:
        """Track a request; raises InvalidRequestError if its id or a sequence id is already in use."""
        taken = [i for i in [request_id] + [c.request_id for c in children] if self.has(i)]
        if taken:
            raise InvalidRequestError(f"request id {taken[0]!r} is already in use; pass a unique request id")
        for child in children:
            # the sequence feeds it as tokens are committed (and finds stop strings there)
            if child.sampling_params.detokenize:
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params)
        self.parents[request_id] = ParentState(request_id, prompt, prompt_token_ids, children,
                                               children[0].arrival_time)
        self.sequence_ids.update(c.request_id for c in children)

    def has(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.sequence_ids

    def _forget(self, parent: ParentState) -> None:
        del self.parents[parent.request_id]
        self.sequence_ids.difference_update(c.request_id for c in parent.children)

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent of ``requests``; finished parents are forgotten."""
        touched: dict[str, ParentState] = {}
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

    def _make_output(self, parent: ParentState) -> RequestOutput:
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
