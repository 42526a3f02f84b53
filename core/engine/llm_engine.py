"""LLMEngine: builds the selected components once, then steps: schedule, execute, update, emit."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from pagoda.config import EngineConfig
from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.lanes import Lanes
from pagoda.engine.metrics import EngineStats, SpecDecodeStats
from pagoda.engine.request_limits import RequestLimits
from pagoda.errors import ConfigError, InvalidRequestError, StepFailedError
from pagoda.execution.lora_request import LoRARequest
from pagoda.host.settings import HostTuning
from pagoda.kv.tiers import has_offload_tiers
from pagoda.outputs import EngineOutput, OutputProcessor, RequestOutput, RequestOutputKind, RequestTracker
from pagoda.registry.plugin_manager import PluginManager, get_plugin_manager
from pagoda.sampling.structured.after_reasoning import after_reasoning
from pagoda.sampling.structured.manager import StructuredOutputs
from pagoda.sampling_params import SamplingParams
from pagoda.sequence import Sequence, SequenceStatus
from pagoda.step import RunnerOutput, SchedulerOutput

logger = logging.getLogger("pagoda")

PromptType = Union[str, dict[str, Any], list[int]]


@dataclass
class StepInFlight:
    """A step scheduled and submitted, not yet committed: its lane, its schedule, the executor's handle (None:
    executed when collected), when it was submitted, and the sequences whose aborts wait for it."""

    lane: int
    sched: SchedulerOutput
    handle: Optional[object]
    submitted: float
    aborts: list[str] = field(default_factory=list)

    @property
    def sequences(self) -> tuple[Sequence, ...]:
        return decided_in(self.sched)


def decided_in(sched: SchedulerOutput) -> tuple[Sequence, ...]:
    """The sequences a schedule decided about: scheduled, preempted or failed in it."""
    return (*sched.requests, *sched.preempted, *(req for req, _ in sched.failed))


class LLMEngine:
    """The offline engine. Not thread-safe: one caller steps it (the async engine wraps it for servers)."""

    def __init__(self, config: EngineConfig, plugin_manager: Optional[PluginManager] = None) -> None:
        self.config = config
        self.pm = plugin_manager or get_plugin_manager()
        # the process-wide host settings (threads, allocator) hold before any kernel runs; the per-engine ones
        # reach the components with the config (config.model.host)
        self.host = HostTuning(config)
        from pagoda.engine.components import build_components

        parts = build_components(config, self.pm)
        self.tokenizer = parts.tokenizer
        self.model = parts.model
        self.backend = parts.backend
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        # a KV connector's loads and saves (None: off); the scheduler calls it, the engine closes it
        self.kv_transfers = parts.kv_transfers
        self.runner = parts.runner  # rank 0's (the only one without tensor parallelism)
        # runs each step on every rank: the runner itself, or the ranks of a tensor-parallel model
        self.executor = parts.executor
        self.num_blocks = parts.num_blocks
        # the split of the KV cache when sliding-window layers keep only their window (None: off)
        self.window_pool = parts.runner.window_pool
        # the tokens that end a sequence; the first is "the" EOS (the other ones ride along on each sequence)
        self.eos_token_ids = parts.eos_token_ids
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.more_eos_token_ids = tuple(self.eos_token_ids[1:])
        # the engine's side of the requests (their sequences, each step's new tokens) and the output side
        # that step() turns those into RequestOutputs with (an async engine keeps its own output side)
        self.requests = RequestTracker(self.tokenizer)
        # what add_request checks every request against
        self.request_limits = RequestLimits(config.model.max_model_len, config.model.vocab_size, self.num_blocks,
                                            self.kv_manager.blocks_needed, config.model.max_logprobs)
        # structured outputs: each request's compiled constraint (compiled off the loop, cached) and the
        # bitmask of each step's grammar rows
        self.structured_outputs = StructuredOutputs(config, self.pm, self.tokenizer,
                                                    list(self.eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer)
        # request counters and latency histograms (Prometheus /metrics), None with disable_log_stats
        self.stats = EngineStats() if config.log_stats else None
        # speculative decoding's acceptance counters, None when off
        self.spec_stats = SpecDecodeStats(config.speculative.num_speculative_tokens) if config.speculative else None
        # step observers: ``before_step(engine, sched)`` once a step is scheduled and
        # ``after_step(engine, sched, result, seconds)`` once it is emitted (benchmarks, --profile, and the host
        # tuning only when thread re-checks are asked for: by default nothing of pagoda.host runs per step)
        self.observers: list[Any] = [self.host] if self.host.observes_steps else []
        # seconds each phase of the last step took: schedule, execute, update, emit
        self.last_step_timings: dict[str, float] = {}
        self._has_finish_observers = bool(self.pm.hook.pagoda_request_finished.get_hookimpls())
        # the steps in flight, oldest first: scheduled and submitted, not yet committed. At most
        # ``max_steps_in_flight``: 1 (each step committed before the next is scheduled), or with pipeline stages
        # ``pipeline_batches_in_flight``, the sequences split into that many lanes (pagoda.engine.lanes)
        self.lanes = self._lanes(config.parallel.pipeline_batches_in_flight)
        self.max_steps_in_flight = 1 if self.lanes is None else self.lanes.num_lanes
        self.in_flight: deque[StepInFlight] = deque()
        self.step_of: dict[str, StepInFlight] = {}  # request id -> the step in flight it is in
        self.most_steps_in_flight = 0  # the most steps in flight at once so far
        self._ids = itertools.count()
        # the LoRA adapters served by name (--lora-modules, and those added at run time): name -> request
        self.loras: dict[str, LoRARequest] = {}
        if config.lora is not None:
            for i, (name, path) in enumerate(config.lora.lora_modules, start=1):
                try:
                    self.add_lora(LoRARequest(name, i, path))
                except InvalidRequestError as exc:
                    raise ConfigError(f"--lora-modules {name}={path}: {exc}") from None

    def shutdown(self) -> None:
        """Stop the executor's other processes (tensor parallelism); the engine runs nothing after it."""
        if has_offload_tiers(self.kv_manager) and self.kv_manager.tiers is not None:
            # the prefix blocks in the pool and in RAM go to the disk tier, for the next engine on the directory
            sched = SchedulerOutput(kv_tier_moves=self.kv_manager.spill_to_disk())
            if sched.kv_tier_moves:
                self.executor.move_blocks(sched)
            self.runner.kv_tiers.flush()  # every block file whole before the engine stops
        if self.kv_transfers is not None:
            self.kv_transfers.close()  # every queued save written first
        self.structured_outputs.shutdown()
        self.executor.shutdown()

    def _lanes(self, n: int) -> Optional[Lanes]:
        """The lanes of ``n`` steps in flight, or None: one step at a time (with a warning when ``n`` > 1 and
        the scheduler or executor cannot keep more than one)."""
        if n <= 1:
            return None
        if self.scheduler.schedule_excluding is None:
            logger.warning("pipeline_batches_in_flight=%d: the %r scheduler has no schedule_excluding(), so steps "
                           "run one at a time", n, self.config.scheduler.policy)
            return None
        if getattr(self.executor, "submit", None) is None or getattr(self.executor, "collect", None) is None:
            logger.warning("pipeline_batches_in_flight=%d: the %r executor has no submit()/collect(), so steps run "
                           "one at a time", n, self.config.parallel.distributed_executor_backend)
            return None
        return Lanes(n)

    def is_in_flight(self, request_id: str) -> bool:
        """Whether a sequence is in a step submitted and not yet committed."""
        return request_id in self.step_of

    @property
    def num_threads(self) -> int:
        """Threads compute runs on now (a measured count can change while the engine runs)."""
        return self.host.num_threads

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
                    arrival_time: Optional[float] = None, priority: Optional[int] = None,
                    output_kind: Optional[RequestOutputKind] = RequestOutputKind.CUMULATIVE,
                    tenant: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> str:
        """Validate and queue a request. Raises InvalidRequestError, leaving the engine untouched.

        ``tenant``: who sent it (the ``fair`` scheduling policy shares the engine between tenants).
        ``output_kind``: what :meth:`step` returns for the request (cumulative outputs by default); None when
        the caller makes its outputs itself from :meth:`step_engine_outputs`. ``lora_request``: the adapter the
        request runs with (None: the base model), loaded and checked here.
        """
        params = params or SamplingParams(**self.config.model.sampling_defaults)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.requests.has(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            text, token_ids = self._truncated(text, token_ids, params.truncate_prompt_tokens)
        self.request_limits.check(token_ids, params)
        bad_words_token_ids = self._bad_words_token_ids(params.bad_words) if params.bad_words else []
        if lora_request is not None:
            self._load_lora(lora_request)
        # waits only if the constraint is still compiling (the server adds a request once it has compiled)
        grammar = self.structured_outputs.compiled(params.structured_outputs) if params.structured_outputs else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        prio = params.priority if priority is None else priority
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            children.append(Sequence(child_id, token_ids, params, self.eos_token_id, arrival, text, prio,
                                    parent_id=request_id, seed=seed, tenant=tenant, lora_request=lora_request,
                                    more_eos_token_ids=self.more_eos_token_ids))
            if grammar is not None:  # each sequence its own place in the grammar
                children[-1].grammar = self._matcher(grammar, params.structured_outputs, text, token_ids)
            children[-1].bad_words_token_ids = bad_words_token_ids
        self.requests.add(request_id, text, token_ids, children)  # also gives stop strings their detokenizer
        if output_kind is not None:
            self.output_processor.add(request_id, text, token_ids, params, output_kind)
        for child in children:
            self.scheduler.add_request(child)
        if self.lanes is not None:
            self.lanes.add(children)
        if self.stats is not None:
            self.stats.on_arrival(len(token_ids))
        return request_id

    def _truncated(self, text: Optional[str], token_ids: list[int], keep: int) -> tuple[Optional[str], list[int]]:
        """The prompt's last ``keep`` tokens (-1: as many as leave room for one generated token); the text is
        dropped when tokens were cut (it no longer matches them)."""
        if keep == -1:
            keep = self.config.model.max_model_len - 1
        if len(token_ids) <= keep:
            return text, token_ids
        return None, token_ids[len(token_ids) - keep:]

    def _matcher(self, grammar: Any, spec: Any, prompt_text: Optional[str], token_ids: list[int]) -> Any:
        """A new sequence's matcher of ``grammar``; with ``spec.reasoning_parser``, one that starts where that
        parser (made for the prompt) finds the end of the thinking."""
        matcher = grammar.new_matcher()
        if spec.reasoning_parser is None:
            return matcher
        hook = "pagoda_reasoning_parsers"
        if spec.reasoning_parser not in self.pm.names(hook):
            raise InvalidRequestError(f"unknown reasoning parser {spec.reasoning_parser!r} in "
                                      "structured_outputs.reasoning_parser; known: " + ", ".join(self.pm.names(hook)),
                                      param="structured_outputs.reasoning_parser")
        prompt = prompt_text if prompt_text is not None else self.tokenizer.decode(token_ids)
        parser = self.pm.get(hook, spec.reasoning_parser, "structured_outputs.reasoning_parser").factory(prompt)
        if not hasattr(parser, "reasoning_end"):
            raise InvalidRequestError(f"the reasoning parser {spec.reasoning_parser!r} cannot tell where the thinking "
                                      "ends in token ids (it has no reasoning_end), so a constraint cannot start "
                                      "after the thinking; send the request without structured outputs, or use a "
                                      "parser that has it", param="structured_outputs.reasoning_parser")
        return after_reasoning(matcher, parser, self.tokenizer)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as the tokenizer writes the word alone and after a space (a word inside a
        sentence): both spellings are banned."""
        found: list[list[int]] = []
        for word in bad_words:
            for spelling in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(spelling, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    # ---- LoRA adapters --------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Serve an adapter by its name (the OpenAI ``model`` field): loaded and checked now. Raises
        InvalidRequestError naming what is wrong, leaving the adapters served as they were."""
        if lora_request.lora_name in self.loras:
            raise InvalidRequestError(f"a LoRA adapter named {lora_request.lora_name!r} is already served; unload it "
                                      "first or choose another name")
        if lora_request.lora_name == self.config.model.served_model_name:
            raise InvalidRequestError(f"{lora_request.lora_name!r} is the base model's name; give the adapter "
                                      "another name")
        self._load_lora(lora_request)
        # a new mapping, never a change in place: a server's event loop reads it while this thread steps
        self.loras = {**self.loras, lora_request.lora_name: lora_request}

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Stop serving an adapter by name and drop its weights from memory (requests running with it reload
        them). Raises InvalidRequestError if no adapter has that name."""
        lora_request = self.loras.get(lora_name)
        if lora_request is None:
            raise InvalidRequestError(f"no LoRA adapter named {lora_name!r} is served; the adapters are "
                                      f"{sorted(self.loras) or 'none'}")
        self.loras = {name: r for name, r in self.loras.items() if name != lora_name}
        self.runner.lora.remove_adapter(lora_request.lora_int_id)
        return lora_request

    def next_lora_id(self) -> int:
        """An adapter id no served or loaded adapter has."""
        used = {r.lora_int_id for r in self.loras.values()} | set(self.runner.lora.loaded_ids())
        return max(used, default=0) + 1

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """The adapters of the running requests and of the waiting ones (preempted and swapped included), by
        name, sorted. Safe to call from another thread: it reads copies."""
        running, waiting = set(), set()
        for group in list(self.requests.parents.values()):
            for seq in list(group.children):
                if seq.lora_request is not None and not seq.is_finished:
                    is_running = seq.status is SequenceStatus.RUNNING
                    (running if is_running else waiting).add(seq.lora_request.lora_name)
        return sorted(running), sorted(waiting)

    def _load_lora(self, lora_request: LoRARequest) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a pagoda.LoRARequest, not {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is off; start the "
                                      "engine with enable_lora=True (--enable-lora)")
        self.runner.lora.add_adapter(lora_request)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Cancel requests (by the id given to add_request) in any state; their blocks are freed at once (a
        sequence in a pipeline step still in flight: once that step is collected)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.output_processor.abort(rid)
            parent = self.requests.parents.get(rid)
            if parent is None:
                continue
            children = [c.request_id for c in parent.children if not c.is_finished]
            self.scheduler.abort_requests(self._defer_aborts(children))
            self.requests.forget(rid)

    def sequences_of(self, request_id: str) -> list[Sequence]:
        """The sequences (``n`` of them) generated for a user request; empty once it is finished."""
        parent = self.requests.parents.get(request_id)
        return list(parent.children) if parent is not None else []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration (:meth:`step_engine_outputs`), its new tokens turned into the requests' outputs.

        Raises :class:`StepFailedError` as :meth:`step_engine_outputs` does.
        """
        engine_outputs = self.step_engine_outputs()
        t0 = time.perf_counter()
        outputs = self.output_processor.process(engine_outputs)
        self.last_step_timings["output"] = time.perf_counter() - t0
        return outputs

    def step_engine_outputs(self) -> list[EngineOutput]:
        """One iteration: schedule, execute, update, emit; each touched request's new tokens, no text.

        With steps in flight (pipeline stages, ``pipeline_batches_in_flight`` > 1), steps are scheduled and
        submitted until that many are in flight, and the oldest is collected, committed and emitted: its
        successors run in the later stages meanwhile. With one (the default), that is schedule a step, run it,
        commit it. Steps are committed in the order scheduled, so the scheduler's contract holds per step.

        Raises :class:`StepFailedError` (after rolling the step back) only when the step's execution
        fails for every request in it; a request whose execution fails alone ends with an error.
        """
        t0 = time.perf_counter()
        timings = {"schedule": 0.0, "execute": 0.0}
        self._schedule_steps(timings)
        step = self.in_flight.popleft() if self.in_flight else None
        t1 = time.perf_counter()
        result = self._collect(step) if step is not None else None
        t2 = time.perf_counter()
        progressed = self._update(step.sched, result) if step is not None else []
        t3 = time.perf_counter()
        outputs = self._emit(progressed)
        t4 = time.perf_counter()
        self.last_step_timings = {"schedule": timings["schedule"], "execute": timings["execute"] + t2 - t1,
                                  "update": t3 - t2, "emit": t4 - t3}
        if step is not None:
            if self.stats is not None:
                self.stats.on_step_time(t4 - t0)
            for observer in self.observers:
                observer.after_step(self, step.sched, result, t4 - t0)
        return outputs

    def _schedule_steps(self, timings: dict[str, float]) -> None:
        """Schedule steps and submit them until :attr:`max_steps_in_flight` are in flight (one schedule per call
        without lanes). A schedule that runs no request is committed at once: its block moves run, its failures
        and preemptions commit (nothing of its lane is in flight)."""
        for _ in range(self.max_steps_in_flight):
            if len(self.in_flight) >= self.max_steps_in_flight:
                return
            t0 = time.perf_counter()
            if self.lanes is None:
                lane, sched = 0, self.scheduler.schedule()
            else:
                lane = self.lanes.take_turn({step.lane for step in self.in_flight})
                if lane is None:
                    return
                sched = self.scheduler.schedule_excluding(self.lanes.busy(lane, self.step_of))
                self._check_in_flight_left_alone(sched)
            for observer in self.observers:
                observer.before_step(self, sched)
            t1 = time.perf_counter()
            timings["schedule"] += t1 - t0
            if not sched.requests:
                if sched.has_block_moves:  # swaps and copies run on every rank (after the steps in flight)
                    self._prepare(sched)
                self._update(sched, None)
                for observer in self.observers:
                    observer.after_step(self, sched, None, time.perf_counter() - t0)
                if self.kv_transfers is not None and self.kv_transfers.has_pending_loads and not self.in_flight:
                    self.kv_transfers.wait_for_loads(0.005)  # nothing to run but requests whose KV is on its way
                continue
            self._prepare(sched)  # block moves, grammar rows; raises StepFailedError (rolled back)
            # without lanes the step runs when collected: execute() is the executor's whole step
            handle = None if self.lanes is None else self.executor.submit(sched)
            step = StepInFlight(lane, sched, handle, t1)
            timings["execute"] += time.perf_counter() - t1
            self.in_flight.append(step)
            self.most_steps_in_flight = max(self.most_steps_in_flight, len(self.in_flight))
            for seq in step.sequences:
                self.step_of[seq.request_id] = step

    def _check_in_flight_left_alone(self, sched: SchedulerOutput) -> None:
        """A scheduler that touched a sequence in flight broke :meth:`Scheduler.schedule_excluding`."""
        for seq in decided_in(sched):
            if seq.request_id in self.step_of:
                raise RuntimeError(f"the {self.config.scheduler.policy!r} scheduler's schedule_excluding() "
                                   f"touched {seq.request_id}, which is in a step still in flight; it must leave "
                                   "the busy request ids alone")

    def _collect(self, step: StepInFlight) -> RunnerOutput:
        """The step's result (run now when it was not submitted), its fault isolated if its execution raised;
        then its sequences are no longer in flight and the aborts that waited for it take effect."""
        try:
            try:
                if step.handle is None:
                    result = self.executor.execute(step.sched)
                else:
                    result = self.executor.collect(step.handle)
            except Exception as exc:  # noqa: BLE001 - isolated: one request's fault must not fail the others
                result = self._isolate_fault(step.sched, exc)
            result.execute_seconds = time.perf_counter() - step.submitted
            return result
        finally:
            for seq in step.sequences:
                self.step_of.pop(seq.request_id, None)
            if step.aborts:
                self.scheduler.abort_requests(step.aborts)

    def _defer_aborts(self, request_ids: list[str]) -> list[str]:
        """Of ``request_ids`` (sequences to abort), those to abort now; the others are in a step in flight,
        whose later stages may still write their blocks, and are aborted when it is collected."""
        now = []
        for rid in request_ids:
            step = self.step_of.get(rid)
            if step is None:
                now.append(rid)
            else:
                step.aborts.append(rid)
        return now

    def _prepare(self, sched: SchedulerOutput) -> None:
        """What runs before the step: its block moves (on every rank) and its grammar rows' bitmask. A failed
        block move rolls the step back and raises :class:`StepFailedError`."""
        try:
            failed_loads = self.executor.move_blocks(sched) if sched.has_block_moves else []
        except Exception as exc:
            self.scheduler.rollback(sched)
            raise StepFailedError(f"moving KV blocks failed: {type(exc).__name__}: {exc}",
                                  self._user_request_ids(sched.requests)) from exc
        if failed_loads:
            # offload-tier blocks that failed their check: the runner recomputes them; the books forget them
            self.kv_manager.drop_failed_loads(failed_loads)
        if any(r.grammar is not None for r in sched.requests):
            # the grammar rows' allowed tokens, filled once: a re-run of the step (_isolate_fault) reuses them, and
            # only update() advances the matchers
            self.structured_outputs.fill_bitmask(sched)

    def _isolate_fault(self, sched: SchedulerOutput, first: Exception) -> RunnerOutput:
        """The step's execution raised. Run it once more (a passing fault costs one retry), then in halves
        down to single requests: a request that fails alone ends with an error and the others go on.
        If every request fails even alone, the step is rolled back and :class:`StepFailedError` raised.

        Running part of a step again is safe: execution writes K/V only at the step's new positions.
        """
        logger.warning("a step failed (%s: %s); running it again to isolate the fault",
                       type(first).__name__, first, exc_info=first)
        try:
            return self.executor.execute(sched)
        except Exception as exc:  # noqa: BLE001
            last = exc
        n = len(sched.requests)
        parts: list[tuple[list[int], RunnerOutput]] = []
        failed: dict[int, Exception] = {}

        def run(indices: list[int]) -> None:
            nonlocal last
            try:
                parts.append((indices, self.executor.execute(sched.select(indices))))
            except Exception as exc:  # noqa: BLE001
                last = exc
                if len(indices) == 1:
                    failed[indices[0]] = exc
                else:
                    run(indices[:len(indices) // 2])
                    run(indices[len(indices) // 2:])

        if n > 1:
            run(list(range(n // 2)))
            run(list(range(n // 2, n)))
        else:
            failed[0] = last
        if len(failed) == n:
            self.scheduler.rollback(sched)
            raise StepFailedError(
                f"the step failed for each of its {n} request(s), even run alone: {type(last).__name__}: {last}",
                self._user_request_ids(sched.requests)) from last
        result = RunnerOutput.merge(n, parts)
        for i, exc in failed.items():
            logger.error("request %s failed alone and is ended: %s: %s", sched.requests[i].request_id,
                         type(exc).__name__, exc)
            result.failed[i] = f"the engine failed on this request: {type(exc).__name__}: {exc}"
        return result

    def self_check(self) -> Optional[str]:
        """Run one token of a one-token prompt through the runner, outside the scheduler (no request is
        touched). Returns None if it works, else what failed; None too when no KV block is free to try."""
        probe = Sequence("pagoda-self-check", [self.eos_token_id or 0], SamplingParams(temperature=0.0, max_tokens=1))
        if not self.kv_manager.allocate_slots(probe, 1):
            return None
        try:
            sched = SchedulerOutput()
            sched.add(probe, 1, 0, self.kv_manager.block_table(probe.request_id))
            if has_offload_tiers(self.kv_manager):
                # the probe's block may have held a cached block: its offload copy goes before the probe writes
                sched.kv_tier_moves = self.kv_manager.take_tier_moves()
                self.executor.move_blocks(sched)
            self.executor.execute(sched)
            return None
        except Exception as exc:  # noqa: BLE001 - the answer is what failed
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.kv_manager.free(probe)

    @staticmethod
    def _user_request_ids(requests: Iterable[Sequence]) -> list[str]:
        return sorted({r.parent_id or r.request_id for r in requests})

    def _update(self, sched: SchedulerOutput, result: Optional[RunnerOutput]) -> list[Sequence]:
        if result is None:
            if not (sched.failed or sched.preempted):
                return []
            result = RunnerOutput.empty(0)  # nothing ran, but preemptions and failures are committed
        if self.stats is None:
            progressed = self.scheduler.update(sched, result)
        else:
            before = [r.num_output_tokens for r in sched.requests]
            progressed = self.scheduler.update(sched, result)
            num_new = sum(r.num_output_tokens - b for r, b in zip(sched.requests, before))
            self.stats.on_step(sched, progressed, time.monotonic(), num_new)
        if self.spec_stats is not None:
            for k, tokens in zip(result.num_draft_tokens, result.sampled_token_ids):
                if k:
                    self.spec_stats.observe(k, len(tokens) - 1)
        return progressed

    def _emit(self, progressed: list[Sequence]) -> list[EngineOutput]:
        finished = self.scheduler.drain_finished()
        for req in finished:
            if self.stats is not None:
                self.stats.on_finished(req)
            if self._has_finish_observers:
                self.pm.notify_request_finished(req)
        return self.requests.make_outputs(progressed + finished)

