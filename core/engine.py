"""LLMEngine: builds the selected components once, then steps: schedule, execute, update, emit."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Iterable, Optional, Union

from pagoda import hugepages
from pagoda.config import EngineArgs, EngineConfig
from pagoda.errors import InvalidRequestError
from pagoda.metrics import EngineStats
from pagoda.output_processor import OutputProcessor
from pagoda.outputs import RequestOutput
from pagoda.plugin_manager import PluginManager, get_plugin_manager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.threads import ThreadGovernor, configure_threads

logger = logging.getLogger("pagoda")

PromptType = Union[str, dict[str, Any], list[int]]


class LLMEngine:
    """The offline engine. Not thread-safe: one caller steps it (the async engine wraps it for servers)."""

    def __init__(self, config: EngineConfig, plugin_manager: Optional[PluginManager] = None) -> None:
        self.config = config
        self.pm = plugin_manager or get_plugin_manager()
        self.num_threads = configure_threads(config.parallel.cpu_threads)
        # a measured count is measured again now and then (see ThreadGovernor); a set one stays.
        # Benchmarks set this to None to hold one configuration for a whole run.
        self.thread_governor = ThreadGovernor.for_setting(config.parallel.cpu_threads, self.num_threads)
        from pagoda.components import build_components

        parts = build_components(config, self.pm)
        self.tokenizer = parts.tokenizer
        self.model = parts.model
        self.backend = parts.backend
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.num_blocks = parts.num_blocks
        self.eos_token_id = parts.eos_token_id
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        # speculative decoding's acceptance counters (pagoda.spec_decode.SpecDecodeStats), None when off
        self.spec_stats = None
        if config.speculative is not None:
            from pagoda.spec_decode import enable_speculation

            self.spec_stats = enable_speculation(config, self.pm, self.runner, self.scheduler)
        self._has_finish_observers = bool(self.pm.hook.pagoda_request_finished.get_hookimpls())
        self._ids = itertools.count()
        self._largest_step = 0  # tokens of the largest step so far (see step())

    @classmethod
    def from_engine_args(cls, args: EngineArgs, plugin_manager: Optional[PluginManager] = None) -> "LLMEngine":
        return cls(args.create_engine_config(), plugin_manager)

    # ---- requests ------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (list of ints)")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidRequestError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def add_request(self, request_id: Optional[str], prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, priority: Optional[int] = None) -> str:
        """Validate and queue a request. Raises InvalidRequestError, leaving the engine untouched."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate(token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        prio = params.priority if priority is None else priority
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            children.append(Request(child_id, token_ids, params, self.eos_token_id, arrival, text, prio,
                                    parent_id=request_id, seed=seed))
        self.output_processor.add(request_id, text, token_ids, children)
        for child in children:
            self.scheduler.add_request(child)
        self.stats.on_arrival(len(token_ids))
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.model.max_model_len
        vocab = self.config.model.vocab_size
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        if len(token_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {max_len}, which must leave room "
                f"for at least one generated token; shorten the prompt to at most {max_len - 1} tokens"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or ()))):
            out_of_vocab = [t for t in ids if t >= vocab]
            if out_of_vocab:
                raise InvalidRequestError(f"{name} has token ids {out_of_vocab[:5]} outside the vocabulary [0, {vocab})")
        need = self.kv_manager.blocks_needed(len(token_ids) + 1)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {need} KV blocks but the cache holds {self.num_blocks}; raise "
                "--kv-cache-memory-bytes or shorten the prompt"
            )

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Cancel requests (by the id given to add_request) in any state; their blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self.output_processor.parents.get(rid)
            if parent is None:
                continue
            self.scheduler.abort_requests([c.request_id for c in parent.children if not c.is_finished])
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update, emit."""
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched) if not sched.is_empty else None
        if sched.num_batched_tokens > 1.25 * self._largest_step:
            # the heap just grew to hold this step's activations: back it with huge pages (a few times
            # in a process's life: each advice collapses what the heap gained since the last)
            self._largest_step = sched.num_batched_tokens
            hugepages.advise_heap()
        if self.thread_governor is not None and result is not None:
            self.num_threads = self.thread_governor.maybe_retune()
        progressed = self._update(sched, result)
        return self._emit(progressed)

    def _update(self, sched, result) -> list[Request]:
        if result is None:
            return []
        now = time.monotonic()
        for req, lp, plp, start in zip(sched.requests, result.logprobs, result.prompt_logprobs,
                                       sched.num_computed_before):
            if lp is not None and req.logprobs is not None:
                req.logprobs.append(lp)
            # after a recompute preemption the prompt is computed again; record it once
            if plp is not None and req.prompt_logprobs is not None and len(req.prompt_logprobs) == start + 1:
                req.prompt_logprobs.extend(plp)
        if self.spec_stats is not None:
            num_before = sum(r.num_output_tokens for r in sched.requests)
        progressed = self.scheduler.update(sched, result.sampled_token_ids)
        if self.spec_stats is not None:
            # a verified run appends several tokens; on_step below counts one per request
            extra = sum(r.num_output_tokens for r in sched.requests) - num_before - len(progressed)
            self.stats.num_generation_tokens += extra
        for req in progressed:
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
        self.stats.on_step(sched, progressed, now)
        return progressed

    def _emit(self, progressed: list[Request]) -> list[RequestOutput]:
        self.output_processor.detokenize(progressed, self.scheduler.finish)
        finished = self.scheduler.drain_finished()
        for req in finished:
            self.stats.on_finished(req)
            if self._has_finish_observers:
                self.pm.notify_request_finished(req)
        return self.output_processor.make_outputs(progressed + finished)
