"""Scheduling policy and KV allocator checks, without a model.

Each check drives randomised request streams (shared prefixes, ``n > 1``,
aborts, a pool small enough to preempt, recompute and swap) through pagoda's
scheduler with the policy under test (or the default policy over the allocator
under test) and :class:`SimRunner`, a model-free runner that keeps the token id
written into every KV slot. Requests carry priorities (small ranks and
deadline-like values), so a policy ordering by them is exercised. It raises
:class:`ContractError` naming the seed, the step, the operation, the rule
broken and the method most likely at fault: a step over its token budget or
``max_num_seqs``, progress moved outside ``update``, a victim that is not one
of ``choose_victim``'s candidates, a running request leaving the queue without
``preempt()``, a waiting key that changes while its request waits, a hook
breaking a rule the scheduler enforces (a busy request preempted, an order that
is not a reordering), a sequence attending to K/V that is not its own, a double
free, a block handed out twice, blocks not given back, a request not finished
within ``MAX_STEPS_TO_FINISH`` steps of its arrival (liveness: a policy that
never admits fails here), a sequence that ends with the wrong tokens.

Progress is checked around each ``schedule()`` call: every sequence's computed
tokens, output tokens and end are recorded before it and must be unchanged
after it, since only ``update()`` commits a step.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.errors import SchedulingPolicyError
from pagoda.interfaces import KVAllocatorFactory, SchedulerFactory
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling import Scheduler, SchedulingPolicy, check_policy_options
from pagoda.sequence import Sequence, SequenceStatus
from pagoda.step import RunnerOutput, SchedulerOutput
from pagoda.testing.contract import ContractError, Where
from pagoda.testing.watch import COUNT_RULE, COUNT_SUSPECT, PolicyWatch, count_disagreement

AllocatorFactory = KVAllocatorFactory


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic token id from the whole context."""
    h = len(context)
    for t in context[-6:]:
        h = (h * 1000003 + t) & 0xFFFFFFFF
    return 100 + h % 5000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class SimRunner:
    """Executes schedules on simulated KV contents: the token id written into each slot (and swap slot).

    It performs a schedule's block moves, writes the scheduled tokens into their slots and checks that
    every sequence's context in its block table is exactly its own tokens (what real attention relies
    on); its "model" samples ``next_token`` of that context.
    """

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0, check: bool = True) -> None:
        self.block_size = block_size
        self.cache: list[list[Optional[int]]] = [[None] * block_size for _ in range(num_blocks)]
        self.swap: list[list[Optional[int]]] = [[None] * block_size for _ in range(num_swap_blocks)]
        # the offload tiers' contents: RAM slot -> tokens, block hash -> tokens (a block file)
        self.ram: dict[int, list[Optional[int]]] = {}
        self.disk: dict[int, list[Optional[int]]] = {}
        self.check = check

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for block, slot in sched.blocks_to_swap_out:
            self.swap[slot] = list(self.cache[block])
        self._move_tiers(sched.kv_tier_moves)
        for slot, block in sched.blocks_to_swap_in:
            self.cache[block] = list(self.swap[slot])
        for src, dst in sched.blocks_to_copy:
            self.cache[dst] = list(self.cache[src])
        bs = self.block_size
        # every layer writes the whole step's K/V before any sequence attends
        for req, table, start, n in zip(sched.requests, sched.block_tables, sched.num_computed_before,
                                        sched.num_new_tokens):
            if len(table) * bs < start + n:
                raise ContractError(f"{req.request_id} computes positions up to {start + n} but its block table "
                                    f"has room for {len(table) * bs}")
            for pos in range(start, start + n):
                self.cache[table[pos // bs]][pos % bs] = req.all_token_ids[pos]
        sampled = []
        for req, table, start, n in zip(sched.requests, sched.block_tables, sched.num_computed_before,
                                        sched.num_new_tokens):
            seq_len = start + n
            context = req.all_token_ids[:seq_len]
            if self.check:
                seen = [self.cache[table[p // bs]][p % bs] for p in range(seq_len)]
                if seen != context:
                    first = next(p for p, (a, b) in enumerate(zip(seen, context)) if a != b)
                    raise ContractError(f"{req.request_id} attends to K/V that is not its own: position {first} "
                                        f"holds token {seen[first]}, not {context[first]}")
            sampled.append([next_token(context)] if seq_len == req.num_tokens else [])
        n = len(sampled)
        return RunnerOutput(sampled, [None] * n, [None] * n, [0] * n)

    def _move_tiers(self, moves) -> None:
        """Offload-tier moves, in the order the real runner performs them (see pagoda.kv.tiers.KVTierMoves)."""
        for block_hash in moves.files_to_delete:
            if self.disk.pop(block_hash, None) is None:
                raise ContractError(f"the disk tier deletes block file {block_hash}, which was never written")
        for slot, block_hash, _ in moves.ram_to_disk:
            self.disk[block_hash] = list(self.ram[slot])
        for block, slot in moves.blocks_to_ram:
            self.ram[slot] = list(self.cache[block])
        for block, block_hash, _ in moves.blocks_to_disk:
            self.disk[block_hash] = list(self.cache[block])
        for slot, block in moves.ram_to_blocks:
            self.cache[block] = list(self.ram[slot])
        for block_hash, block in moves.disk_to_blocks:
            if block_hash not in self.disk:
                raise ContractError(f"the disk tier loads block file {block_hash}, which is not there")
            self.cache[block] = list(self.disk[block_hash])


def _configs(block_size: int, num_blocks: int, budget: int, max_num_seqs: int, preemption_mode: str,
             prefix_caching: bool, chunked: bool) -> tuple[SchedulerConfig, CacheConfig]:
    max_model_len = 200 if chunked else budget
    sched_cfg = SchedulerConfig("checked", max_num_seqs, budget, max_model_len, chunked, 0, None)
    cache_cfg = CacheConfig(block_size, 0, "auto", prefix_caching, num_blocks, 0, preemption_mode, "checked")
    return sched_cfg, cache_cfg


# the settings each check runs under: a pool small enough to preempt, with and without swap and chunking
SETTINGS = [
    dict(preemption_mode="recompute", prefix_caching=True, chunked=True),
    dict(preemption_mode="swap", prefix_caching=True, chunked=True),
    dict(preemption_mode="recompute", prefix_caching=False, chunked=False),
]


# liveness: every request the kit submits finishes (or is aborted) within this many steps of its arrival. The
# streams are small (at most 24 requests of at most ~40 tokens and 7 outputs, 6 seats, a 16-token budget): the
# built-in policies finish each within 80 steps (fcfs 55, priority 75, fair 80 over five seeds)
MAX_STEPS_TO_FINISH = 400


def check_scheduler(factory: SchedulerFactory, allocator: Optional[AllocatorFactory] = None, seeds: int = 3,
                    num_requests: int = 24, options: Optional[dict] = None,
                    urgency: Optional[Callable[[Sequence], Any]] = None) -> None:
    """Drive pagoda's scheduler with the policy ``factory(scheduler, **options)`` (a ``pagoda_schedulers``
    factory) through randomised request streams, one step at a time and then with two steps in flight
    (:func:`pagoda.testing.in_flight.check_steps_in_flight`); ``allocator`` (a ``pagoda_kv_allocators``
    factory) defaults to ``paged``. Raises :class:`ContractError` on the first broken rule.

    ``urgency``: for a policy that promises an order, the key of that promise, smaller first, e.g.
    ``lambda request: request.priority`` for vLLM's priorities or deadlines (read ``request.priority``: the
    priority the engine resolved, which ``LLM.generate(priority=...)`` sets over ``SamplingParams.priority``).
    The check then also fails a victim that is not among the least urgent candidates, a request preempted for
    arrivals that is not less urgent than the waiting request it makes room for, and a waiting queue out of
    urgency order."""
    from pagoda.testing.in_flight import check_steps_in_flight

    options = dict(options or {})
    check_policy_options(str(getattr(factory, "__name__", factory)), factory, options)
    if urgency is not None:
        _check_victim_order(factory, allocator, options, urgency)
    for settings in SETTINGS:
        for seed in range(seeds):
            _run_stream(factory, allocator, settings, seed, num_requests, options, urgency)
    check_steps_in_flight(factory, allocator, seeds, num_requests, options)


def check_kv_allocator(factory: AllocatorFactory, seeds: int = 3) -> None:
    """Check ``factory(cache_config, num_blocks)`` (a ``pagoda_kv_allocators`` factory): direct allocation
    and freeing, then request streams over it under the default (first come, first served) policy, whatever
    scheduling plugins are installed. Raises ContractError."""
    for seed in range(seeds):
        _check_allocation(factory, seed)
    check_scheduler(SchedulingPolicy, allocator=factory, seeds=seeds)


def _make_kv(allocator: Optional[AllocatorFactory], cache_cfg: CacheConfig, num_blocks: int):
    if allocator is None:
        return PagedKVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
    return allocator(cache_cfg, num_blocks)


# the small engine a stream runs on: blocks of 4 tokens, 24 of them, a 16-token budget, 6 seats
STREAM_BLOCK_SIZE, STREAM_NUM_BLOCKS, STREAM_BUDGET, STREAM_MAX_NUM_SEQS = 4, 24, 16, 6


def _stream_setup(factory: SchedulerFactory, allocator: Optional[AllocatorFactory], settings: dict,
                  options: Optional[dict] = None):
    """The scheduler with the policy under test, its KV allocator (with a swap pool when preempting by swap), its
    scheduler config and the simulated runner of one stream."""
    swap_blocks = 16 if settings["preemption_mode"] == "swap" else 0
    sched_cfg, cache_cfg = _configs(STREAM_BLOCK_SIZE, STREAM_NUM_BLOCKS, STREAM_BUDGET, STREAM_MAX_NUM_SEQS,
                                    settings["preemption_mode"], settings["prefix_caching"], settings["chunked"])
    kv = _make_kv(allocator, cache_cfg, STREAM_NUM_BLOCKS)
    kv.init_swap_pool(swap_blocks)
    scheduler = Scheduler(sched_cfg, cache_cfg, kv, factory, options)
    return scheduler, kv, sched_cfg, SimRunner(STREAM_NUM_BLOCKS, STREAM_BLOCK_SIZE, swap_blocks)


def _run_stream(factory: SchedulerFactory, allocator: Optional[AllocatorFactory], settings: dict, seed: int,
                num_requests: int, options: Optional[dict] = None,
                urgency: Optional[Callable[[Sequence], Any]] = None) -> None:
    rng = random.Random(seed)
    num_blocks, budget = STREAM_NUM_BLOCKS, STREAM_BUDGET
    scheduler, kv, sched_cfg, runner = _stream_setup(factory, allocator, settings, options)
    where = Where(str(getattr(factory, "__name__", factory)), seed, ", ".join(f"{k}={v}" for k, v in settings.items()))
    watch = PolicyWatch(scheduler, kv, num_blocks, where, urgency)
    prefixes = [[rng.randrange(100, 5000) for _ in range(12)] for _ in range(2)]
    added: list[Sequence] = []
    aborted: set[str] = set()
    arrived: dict[str, int] = {}  # request id -> the step it was added at
    longest = sched_cfg.max_model_len if settings["chunked"] else budget
    for step in range(5000):
        watch.where = where.at(step)
        if len({r.parent_id for r in added}) < num_requests and rng.random() < 0.5:
            new = _add_request(scheduler, rng, prefixes, len(added), longest, kv, num_blocks)
            arrived.update((r.request_id, step) for r in new)
            added += new
        if added and rng.random() < 0.03:
            victim = rng.choice(added)
            if not victim.is_finished:
                scheduler.abort_requests([victim.request_id])
                aborted.add(victim.request_id)
        done = [r for r in added if r.is_finished] if rng.random() < 0.2 else []
        if done:
            kv.free(rng.choice(done).request_id)  # freeing a finished sequence again (an abort racing its finish)
        watch.check_waiting_keys(set())
        check_liveness(added, arrived, step, watch.where)
        if not scheduler.has_unfinished_requests():
            if len({r.parent_id for r in added}) >= num_requests:
                break
            continue
        progress = _progress(added)
        was_running = {r.request_id for r in scheduler.running}
        sched = _schedule_watched(scheduler, watch)
        _check_no_progress_written(progress, added, watch.where)
        _check_schedule(sched, scheduler, sched_cfg, watch.where, was_running)
        try:
            result = runner.execute(sched)
        except ContractError as exc:
            raise watch.where.fail(
                "the model runner's execute() of the step", str(exc),
                "a sequence attends only to K/V its own tokens wrote, in the blocks of its block table",
                "the KV allocator (a block given to two sequences, or given back while held: free(), "
                "allocate_slots()) or the scheduler's block moves (swap, copy-on-write)") from None
        unfinished = [r for r in added if not r.is_finished]
        try:
            scheduler.update(sched, result)
        except ContractError:
            raise
        except Exception as exc:
            raise raised(watch.where, "update()", exc, scheduler) from exc
        watch.check_books(added, "update()")
        watch.check_finished_hold_nothing([r for r in unfinished if r.is_finished])
    else:
        raise where.fail("the whole stream", "requests still unfinished after 5000 steps",
                         "every request finishes", "the scheduler's schedule() (a request never scheduled)")
    end = where.at("end", "at the")
    for req in added:
        if req.request_id in aborted or req.status == SequenceStatus.FINISHED_ERROR:
            continue
        want = expected_output(req.prompt_token_ids, req.sampling_params.max_tokens)
        if req.status != SequenceStatus.FINISHED_LENGTH or req.output_token_ids != want:
            raise end.fail("the finished requests",
                           f"{req.request_id} ended {req.status.value} with {len(req.output_token_ids)} tokens "
                           f"{req.output_token_ids[:6]}..., not the {len(want)} tokens {want[:6]}...",
                           "a sequence ends with exactly the tokens of its prompt's continuation, however it was "
                           "preempted, swapped or chunked", "the scheduler's update() (committing a step's tokens)")
    if kv.num_free_blocks != num_blocks:
        raise end.fail("the KV allocator's books",
                       f"every sequence ended but {num_blocks - kv.num_free_blocks} of {num_blocks} KV blocks were "
                       "not given back", "a finished, aborted or preempted sequence gives back all its blocks",
                       "the scheduler's finish()/preempt() (a free() not called) or the KV allocator's free()")


def _check_victim_order(factory: SchedulerFactory, allocator: Optional[AllocatorFactory], options: dict,
                        urgency: Callable[[Sequence], Any]) -> None:
    """A pool of 3 blocks: a request of a late deadline (priority 50) runs, an urgent one (priority 1) arrives and
    runs beside it, and the first needs a block the pool no longer has: the victim must be the less urgent."""
    sched_cfg, cache_cfg = _configs(4, 3, 16, 4, "recompute", False, False)
    kv = _make_kv(allocator, cache_cfg, 3)
    scheduler = Scheduler(sched_cfg, cache_cfg, kv, factory, options)
    runner = SimRunner(3, 4)
    where = Where(str(getattr(factory, "__name__", factory)), 0, "a late-deadline request running, an urgent one "
                  "arriving beside it, 3 blocks of 4 tokens")
    watch = PolicyWatch(scheduler, kv, 3, where, urgency)
    arrivals = {0: Sequence("late", list(range(100, 107)), SamplingParams(max_tokens=3, ignore_eos=True, priority=50),
                            None, 0.0, None, 50),
                1: Sequence("urgent", [200, 201, 202], SamplingParams(max_tokens=2, ignore_eos=True, priority=1),
                            None, 1.0, None, 1)}
    for step in range(60):
        watch.where = where.at(step)
        if step in arrivals:
            scheduler.add_request(arrivals[step])
        if not scheduler.has_unfinished_requests():
            return
        sched = _schedule_watched(scheduler, watch)
        scheduler.update(sched, runner.execute(sched))
    raise where.fail("the request stream", "2 requests still unfinished after 60 steps", "every request finishes",
                     "the policy's may_admit() or choose_victim()")


def check_liveness(added: list[Sequence], arrived: dict[str, int], step: int, where: Where) -> None:
    """Every request finishes within ``MAX_STEPS_TO_FINISH`` steps of its arrival (``arrived``: request id -> the
    step it was added at)."""
    for req in added:
        waited = step - arrived[req.request_id]
        if not req.is_finished and waited > MAX_STEPS_TO_FINISH:
            raise where.fail(
                "the request stream", f"{req.request_id} arrived at step {arrived[req.request_id]} and is still "
                f"{req.status.value} {waited} steps later",
                f"liveness: every request finishes within {MAX_STEPS_TO_FINISH} steps of its arrival",
                "the policy's may_admit(), may_swap_in() or order_running() (a request never let in)")


def raised(where: Where, operation: str, exc: Exception, scheduler,
           rule: str = "a component's method answers without raising") -> ContractError:
    """The ContractError of an exception a component raised inside the scheduler, naming the method it came
    from: the innermost frame of the policy's or the allocator's own code, else the key hook whose keys
    pagoda's code compared. ``rule``: the rule broken, unless the keys did not compare."""
    import sys
    import traceback

    # file of each class the policy and the allocator are built from -> whose code it is
    owners: dict[Optional[str], str] = {}
    for component, owner in ((scheduler.policy, "the policy's"), (scheduler.kv, "the KV allocator's")):
        for base in type(component).__mro__[:-1]:
            if base not in (SchedulingPolicy, PagedKVCacheManager):
                owners.setdefault(getattr(sys.modules.get(base.__module__), "__file__", None), owner)
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f"{owners[f.filename]} {f.name}()" for f in frames if f.filename in owners]
    suspect = theirs[-1] if theirs else None
    if isinstance(exc, TypeError) and "not supported between" in str(exc):
        rule = "a key hook's keys are comparable with each other (one type for every request or block, no None " \
               "beside a list)"
        keys = [f"the policy's {name}()" for name in ("waiting_key", "running_key")
                if getattr(type(scheduler.policy), name) is not getattr(SchedulingPolicy, name)]
        if isinstance(scheduler.kv, PagedKVCacheManager) and \
                type(scheduler.kv).eviction_key is not PagedKVCacheManager.eviction_key:
            keys.append("the KV allocator's eviction_key()")
        if keys and not (frames and frames[-1].filename in owners):  # pagoda's code compared the keys
            suspect = " or ".join(keys)
    return where.fail(operation, f"{type(exc).__name__}: {exc}", rule, suspect or "the scheduler's schedule()")


def policy_error(where: Where, operation: str, exc: SchedulingPolicyError):
    """The ContractError of a rule the scheduler refused a policy's hook for, with the seed and step."""
    text = str(exc)
    if "leaves the queue only through" in text:
        rule, suspect = ("a running request leaves the running queue only through preempt()",
                         "the policy's preempt_for_arrivals() (a request moved by hand)")
    elif "in a step still in flight" in text:
        rule, suspect = ("a busy request (in a step still in flight) is never preempted",
                         "the policy's preempt_for_arrivals() or choose_victim() (no self.scheduler.is_busy() check)")
    elif "choose_victim" in text:
        rule, suspect = "the victim is one of the candidates", "the policy's choose_victim()"
    elif "order_" in text:
        rule, suspect = "an order hook returns the requests it was given, reordered", "the policy's order hooks"
    else:
        rule, suspect = "only a running request is preempted", "the policy's preempt_for_arrivals()"
    return where.fail(operation, text, rule, suspect)


def _priority(rng: random.Random, index: int) -> int:
    """A request's priority: a small rank, or a deadline-like value (its arrival plus a slack), so policies
    ordering by priority or by deadline see both ties and spread."""
    return rng.randrange(3) if rng.random() < 0.5 else max(3, index + rng.randrange(-20, 40))


def _add_request(scheduler, rng: random.Random, prefixes: list[list[int]], index: int, longest: int, kv,
                 num_blocks: int) -> list[Sequence]:
    base = rng.choice(prefixes)[:rng.randrange(0, 13)] if rng.random() < 0.5 else []
    ids = (base + [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 30))])[:longest - 8]
    max_tokens = rng.randrange(1, 8)
    if kv.blocks_needed(len(ids) + max_tokens) > num_blocks:
        return []  # the engine refuses such a prompt before it reaches the scheduler
    n = 2 if rng.random() < 0.2 else 1
    parent = f"p{index}"
    priority = _priority(rng, index)
    # as the engine resolves it: every other request carries its priority in SamplingParams.priority, the others
    # get it from LLM.generate(priority=...), over a SamplingParams.priority in the opposite order
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True,
                            priority=priority if index % 2 == 0 else 45 - priority)
    # a few tenants (and requests with none), from the index so the streams' random draws stay as they were
    tenant = None if index % 4 == 0 else "abc"[index % 3]
    children = [Sequence(f"{parent}-{i}", ids, params, None, float(index), None, priority, parent_id=parent,
                         tenant=tenant) for i in range(n)]
    for child in children:
        scheduler.add_request(child)
    return children


def _schedule_watched(scheduler, watch):
    """``scheduler.schedule()`` between the watch's checks; what goes wrong inside is a ContractError naming
    ``schedule()`` at the watch's step."""
    watch.before_schedule()
    try:
        sched = scheduler.schedule()
    except SchedulingPolicyError as exc:
        raise policy_error(watch.where, "schedule()", exc) from None
    except ContractError:
        raise
    except Exception as exc:
        raise raised(watch.where, "schedule()", exc, scheduler) from exc
    watch.after_schedule(sched)
    return sched


def _progress(requests: list[Sequence]) -> dict[str, tuple[int, int, bool]]:
    """What only ``update`` may move: computed tokens, output tokens, whether the sequence ended."""
    return {r.request_id: (r.num_computed_tokens, len(r.output_token_ids), r.is_finished) for r in requests}


def _check_no_progress_written(before: dict[str, tuple[int, int, bool]], requests: list[Sequence],
                               where: Where) -> None:
    """``schedule()`` decides and records; a write to progress inside it is a step that cannot be rolled back."""
    for req in requests:
        computed, num_output, ended = before[req.request_id]
        if req.num_computed_tokens != computed:
            raise where.fail(
                "schedule()", f"schedule() wrote {req.request_id}'s progress: num_computed_tokens {computed} -> "
                f"{req.num_computed_tokens}", "schedule() records where a sequence computes from in the "
                "SchedulerOutput (num_computed_before); only update() moves num_computed_tokens",
                "the policy's on_request_scheduled() (or another hook schedule() calls)")
        if len(req.output_token_ids) != num_output:
            raise where.fail("schedule()", f"schedule() appended tokens to {req.request_id} ({num_output} -> "
                             f"{len(req.output_token_ids)})", "only update() appends sampled tokens",
                             "the scheduler's schedule()")
        if req.is_finished and not ended:
            raise where.fail(
                "schedule()", f"schedule() ended {req.request_id} ({req.status.value})",
                "a sequence that cannot run is recorded in SchedulerOutput.failed with its error, and update() "
                "ends it", "the scheduler's schedule()")


def _check_schedule(sched: SchedulerOutput, scheduler, cfg: SchedulerConfig, where: Where,
                    was_running: set[str]) -> None:
    def fail(seen: str, rule: str, suspect: str = "the scheduler's schedule()") -> ContractError:
        return where.fail("schedule()", seen, rule, suspect)

    if sched.num_batched_tokens > cfg.max_num_batched_tokens:
        raise fail(f"the step batches {sched.num_batched_tokens} tokens, over "
                   f"max_num_batched_tokens={cfg.max_num_batched_tokens}", "a step stays within its token budget")
    if len(scheduler.running) > cfg.max_num_seqs:
        raise fail(f"{len(scheduler.running)} sequences running, over max_num_seqs={cfg.max_num_seqs}",
                   "at most max_num_seqs sequences run", "the scheduler's schedule() (admission, may_admit())")
    ids = [r.request_id for r in sched.requests]
    if len(ids) != len(set(ids)):
        raise fail(f"a sequence appears twice in one step: {sorted(ids)}", "a sequence is scheduled once a step")
    failed = {r.request_id for r, _ in sched.failed}
    for i, req in enumerate(sched.requests):
        if req.request_id in was_running and req.num_computed_tokens != sched.num_computed_before[i]:
            raise fail(f"{req.request_id} was running with {req.num_computed_tokens} tokens computed, but the step "
                       f"computes it from position {sched.num_computed_before[i]}",
                       "a running sequence continues from its committed progress")
        if req.request_id in failed:
            raise fail(f"{req.request_id} is both scheduled and failed in one step",
                       "a sequence in SchedulerOutput.failed does not run")
        if req.status != SequenceStatus.RUNNING:
            raise fail(f"{req.request_id} is scheduled but {req.status.value}", "only running sequences are scheduled")
        if sched.num_new_tokens[i] < 1:
            raise fail(f"{req.request_id} is scheduled with {sched.num_new_tokens[i]} tokens",
                       "a scheduled sequence computes at least one token")
        if sched.num_computed_before[i] + sched.num_new_tokens[i] > req.num_tokens + sched.num_draft_slots[i]:
            raise fail(f"{req.request_id} computes past its known tokens without draft slots",
                       "a sequence computes only tokens it has, plus its draft slots")
    # sequences may share blocks (a prefix hit, a fork), but two never write into one block in a step
    bs = scheduler.kv.block_size
    written: dict[int, str] = {}
    for i, req in enumerate(sched.requests):
        table, start = sched.block_tables[i], sched.num_computed_before[i]
        for block in set(table[start // bs:]):
            if block in written:
                raise fail(f"block {block} is handed to both {written[block]} and {req.request_id}, and both write "
                           "into it this step", "two sequences never write into one block (copy-on-write first)",
                           "the KV allocator's allocate_slots() (copy-on-write) or fork()")
            written[block] = req.request_id


def _check_allocation(factory: AllocatorFactory, seed: int) -> None:
    rng = random.Random(seed)
    block_size, num_blocks = 4, 32
    cache_cfg = CacheConfig(block_size, 0, "auto", True, num_blocks, 0, "recompute", "checked")
    kv = factory(cache_cfg, num_blocks)
    where = Where(str(getattr(factory, "__name__", factory)), seed, "direct allocation")
    live: dict[str, Sequence] = {}
    freed: list[str] = []
    for op in range(400):
        at = where.at(op, "operation")
        free_before = kv.num_free_blocks
        if freed and rng.random() < 0.15:
            rid = rng.choice(freed)
            operation, rule = f"free({rid!r}) of a sequence freed before", "freeing a sequence again changes nothing"
            kv.free(rid)  # freeing again, after others took blocks, must change nothing
        elif rng.random() < 0.05:
            rid = f"never-allocated-{op}"
            operation, rule = f"free({rid!r}) of an id never allocated", "freeing an unknown id changes nothing"
            try:
                kv.free(rid)
            except Exception as exc:
                raise at.fail(operation, f"free() raised {type(exc).__name__}: {exc}", rule,
                              "the KV allocator's free()") from None
        elif live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            operation, rule = f"free({rid!r})", "free() gives back exactly the blocks the sequence held alone"
            kv.free(live.pop(rid))
            freed.append(rid)
        else:
            # distinct tokens: no prefix can be shared, so no two sequences may hold one block
            ids = [10_000 + op * 100 + i for i in range(rng.randrange(1, 20))]
            seq = Sequence(f"s{op}", ids, SamplingParams(max_tokens=1))
            operation, rule = f"allocate_slots({seq.request_id!r}, {len(ids)})", "a block is held by one sequence"
            blocks, cached = kv.get_computed_blocks(seq)
            if cached:
                raise at.fail(f"get_computed_blocks({seq.request_id!r})", f"a prompt of never-seen tokens got "
                              f"{cached} tokens from the prefix cache", "only cached prompts hit the prefix cache",
                              "the KV allocator's get_computed_blocks()")
            if kv.allocate_slots(seq, len(ids), blocks):
                live[seq.request_id] = seq
                table = kv.block_table(seq.request_id)
                if len(table) != kv.blocks_needed(len(ids)):
                    raise at.fail(operation, f"{len(ids)} tokens got {len(table)} blocks, not "
                                  f"{kv.blocks_needed(len(ids))}", "a sequence gets the blocks its tokens need",
                                  "the KV allocator's allocate_slots()")
        held = [b for rid in live for b in kv.block_table(rid)]
        if len(held) != len(set(held)):
            dup = next(b for b in held if held.count(b) > 1)
            raise at.fail(operation, f"block {dup} is handed out twice", rule,
                          "the KV allocator's allocate_slots() or free() (a block back in the pool while held)")
        if kv.num_free_blocks != num_blocks - len(held) or not 0 <= kv.num_free_blocks <= num_blocks:
            seen = (f"{kv.num_free_blocks} blocks reported free, not {num_blocks - len(held)}: {len(held)} of "
                    f"{num_blocks} are held")
            if count_disagreement(kv):  # the count is wrong, whatever the operation did
                seen, rule, suspect = f"{seen}; {count_disagreement(kv)}", COUNT_RULE, COUNT_SUSPECT
            elif operation.startswith("free(") and kv.num_free_blocks > num_blocks - len(held):
                seen, suspect = f"a double free: {seen}", "the KV allocator's free()"
            elif operation.startswith("free("):
                suspect = ("the KV allocator's free() (blocks not given back) or its num_free_blocks() (free blocks "
                           "that still cache a prefix count as free: they are taken again when the pool needs them)")
            else:
                took = len(kv.block_table(seq.request_id)) if seq.request_id in live else 0
                fell = free_before - kv.num_free_blocks
                seen += f"; allocate_slots handed out {took} blocks and num_free_blocks fell by {fell}"
                suspect = ("the KV allocator's allocate_slots() (its books of free blocks)" if fell != took else
                           "the KV allocator's num_free_blocks() (it counts other than the blocks no sequence holds)")
            raise at.fail(operation, seen, rule, suspect)
    for seq in live.values():
        kv.free(seq)
    if kv.num_free_blocks != num_blocks:
        raise where.at("end", "at the").fail("free() of every sequence", f"{kv.num_free_blocks} of {num_blocks} "
                                              "blocks are free", "once every sequence is freed, every block is free",
                                              "the KV allocator's free()")
