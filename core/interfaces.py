"""The contracts components must meet: what each hook's factory returns.

These are :class:`typing.Protocol` classes, checked by shape, not by
inheritance: a plugin needs no pagoda base class (though it may subclass a
built-in, as ``contrib/pagoda-sjf`` does). Everything the engine, the built-in
commands and the conformance kit use of a component is listed here; anything
else is the component's own business.

A member marked *optional* may be left out: pagoda gives a component without
it the default its docstring names when it builds the component
(``pagoda.registry.adapt.adapt_component``), so every member listed here is
read directly and a plugin written for an earlier plugin API keeps working.
"""

from __future__ import annotations

import typing
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Optional, Protocol,
                    runtime_checkable)

if TYPE_CHECKING:
    import torch

    import argparse

    from pagoda.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
    from pagoda.execution.routing import ReplicaLoad, RoutingDecision, RoutingRequest
    from pagoda.execution.window_pool import WindowPoolPlan
    from pagoda.kv.offload import KVTierStore
    from pagoda.kv.tiers import KVTierIndex
    from pagoda.registry.plugin_manager import PluginManager
    from pagoda.sampling.sampler import SamplerOutput
    from pagoda.sampling_params import StructuredOutputsParams
    from pagoda.scheduling.scheduler import SchedulingPolicy
    from pagoda.sequence import Sequence, SequenceStatus
    from pagoda.step import AttentionBatch, KVTierMoves, LoRABatch, RunnerOutput, SchedulerOutput
    from pagoda.reasoning import ReasoningDelta
    from pagoda.tool_calls import DeltaMessage, ExtractedToolCalls


@runtime_checkable
class ModelLoader(Protocol):
    """``pagoda_model_loaders``: fills a built model with weights."""

    def load_weights(self, model: "torch.nn.Module") -> None:
        """Load every parameter; raise :class:`pagoda.errors.CheckpointError` naming a bad tensor."""


@runtime_checkable
class CausalLM(Protocol):
    """``pagoda_model_architectures``: a decoder over flattened, unpadded token batches.

    A ``torch.nn.Module``; of the module API the engine uses only what is listed here. Invariant: a
    token's hidden state depends on its own sequence's tokens only (the K/V it reads through
    ``metadata``), never on the other sequences of the batch.
    """

    # True if ``forward`` accepts fewer ``kv_caches`` than the model has layers and then runs only the
    # first ``len(kv_caches)`` layers (the self-draft proposer runs the model's first layers that way).
    # Optional: False.
    runs_first_layers_of_caches: bool

    # fused layer name -> the checkpoint projections it stacks, in output order (``{"qkv_proj": ["q_proj",
    # "k_proj", "v_proj"]}``): a LoRA adapter's ``q_proj`` applies to slice 0 of ``qkv_proj``. Optional: {}.
    packed_modules_mapping: dict

    # the attention features its layers ask of the backend (``{"sliding_window", "logit_softcap", "sinks"}``);
    # a backend that does not list one is refused at start-up. Optional: none.
    attention_features: set

    # False for an architecture that LoRA adapters cannot apply to (refused at start-up). Optional: True.
    supports_lora: bool

    # ``layer_windows()``: layer index -> sliding window of this process's layers that have one; their K/V go to
    # the window pool (``--kv-window-pool``, docs/models.md), and their attention layers must then pick their
    # pool's metadata from a ``pagoda.step.PoolMetadata``. Optional: {} (no window pool).
    layer_windows: Callable[[], dict]

    # A context manager the runner enters around a forward pass that computes prompt tokens: inside it the
    # model multiplies each prompt row as it would in a cold prefill of any length, so a prefix-cache hit gives
    # a cold prefill's bits (docs/batch_invariance.md). Optional: none (the model keeps its own choice).
    prompt_step: Callable[[], ContextManager[None]]

    def __call__(self, input_ids: "torch.Tensor", positions: "torch.Tensor", kv_caches: list, metadata: Any
                 ) -> "torch.Tensor":
        """Runs :meth:`forward` (``nn.Module.__call__``)."""

    def forward(self, input_ids: "torch.Tensor", positions: "torch.Tensor", kv_caches: list, metadata: Any
                ) -> "torch.Tensor":
        """``[num_tokens]`` ids and positions -> ``[num_tokens, hidden]`` hidden states; ``kv_caches`` holds
        one tensor per layer, shaped by the attention backend, and ``metadata`` is its ``build_metadata``."""

    def compute_logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """``[n, hidden]`` -> ``[n, vocab]`` float32 logits."""

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Take ``(checkpoint_name, tensor)`` pairs; every parameter must be set, and a missing or misshapen
        tensor raises :class:`pagoda.errors.CheckpointError` naming it."""

    def eval(self) -> Any:
        """``nn.Module.eval``: called once after loading."""

    def parameters(self) -> Iterator["torch.Tensor"]:
        """``nn.Module.parameters`` (the runner advises huge pages for them)."""

    def buffers(self) -> Iterator["torch.Tensor"]:
        """``nn.Module.buffers`` (likewise)."""

    def modules(self) -> Iterator[Any]:
        """``nn.Module.modules``: ``--profile`` times the ``pagoda.modeling.layers`` linear and attention modules it
        finds there (a model built of other modules is profiled by engine phase only)."""


@runtime_checkable
class KVCacheManager(Protocol):
    """``pagoda_kv_allocators``: block ids, ref counts, the prefix cache and swap slots (never tensors).

    Invariants: a block is never handed to two sequences unless they share it on purpose (a prefix hit,
    a fork), and then it is read-only until copied (copy-on-write); every block a sequence holds comes
    back to the pool when it is freed; a failed ``allocate_slots`` changes nothing. The block moves it
    decides (swap out, swap in, copy) are returned to the scheduler, which passes them to the runner.

    Optional, for the prefix cache's offload tiers (``--kv-offload-*``): an allocator whose class also
    has the members of :class:`KVOffloadTiers` (as :class:`pagoda.kv.tiers.TieredPrefixCache` does) can
    keep evicted prefix blocks in RAM and on disk; core asks the class (:func:`has_offload_tiers`) before
    using them, and refuses the flags for an allocator without them.
    """

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached but unreferenced blocks count as free)."""

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, in [0, 1]."""

    @property
    def stats(self) -> Any:
        """Prefix-cache counters for ``/metrics``: ``queries`` and ``hits`` (prompt tokens looked up / found)."""

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""

    def block_table(self, request_id: str) -> list[int]:
        """The sequence's block ids in position order (empty if it holds none)."""

    def num_blocks_held(self, request_id: str) -> int: ...

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks that freeing the sequence would give back (those no other sequence holds)."""

    def token_occupancy(self) -> tuple[int, int]:
        """``(tokens held, token slots allocated)`` over held blocks, for KV waste."""

    def get_computed_blocks(self, request: "Sequence") -> tuple[list, int]:
        """Cached blocks covering the start of a sequence not yet computed, and how many tokens they hold
        (always leaving at least one token to compute)."""

    def num_blocks_to_take(self, request: "Sequence", num_new_tokens: int, computed_blocks: typing.Sequence = ()
                           ) -> int:
        """Free blocks :meth:`allocate_slots` would take for this call."""

    def can_allocate(self, request: "Sequence", num_new_tokens: int, computed_blocks: typing.Sequence = ()
                     ) -> bool: ...

    def allocate_slots(self, request: "Sequence", num_new_tokens: int, computed_blocks: typing.Sequence = ()
                       ) -> bool:
        """Room for ``num_new_tokens`` tokens after the sequence's computed ones (sharing ``computed_blocks``
        from :meth:`get_computed_blocks` on a first allocation); False, changing nothing, if short."""

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write moves ``(source block, private copy)`` decided since the last call."""

    def fork(self, source: "Sequence", child: "Sequence", num_tokens: int) -> None:
        """Let ``child`` share the blocks holding ``source``'s first ``num_tokens`` (identical) tokens; the
        child's next ``allocate_slots`` makes room after them (its ``num_computed_tokens`` is still 0 then:
        the scheduler commits progress only in ``update``)."""

    def trim_slots(self, request: "Sequence", num_tokens: int) -> None:
        """Keep room for the first ``num_tokens`` tokens only (after rejected speculative drafts)."""

    def free(self, request: "Sequence | str") -> None:
        """Give back every block and swap slot the sequence holds; full blocks may stay cached."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a failed step, when cached contents cannot be trusted)."""

    def init_swap_pool(self, num_swap_blocks: int) -> None:
        """Size the CPU swap pool (the runner allocates matching tensors); 0 turns swapping off."""

    def can_swap_out(self, request: "Sequence") -> bool: ...

    def swap_out(self, request: "Sequence") -> list[tuple[int, int]]:
        """Release the sequence's blocks into swap slots; returns ``(block, swap slot)`` copies to make."""

    def can_swap_in(self, request: "Sequence", num_new_tokens: int) -> bool: ...

    def swap_in(self, request: "Sequence") -> list[tuple[int, int]]:
        """Bring a swapped sequence back; returns ``(swap slot, block)`` copies to make."""

    def is_swapped(self, request_id: str) -> bool:
        """Whether the sequence's blocks are in the swap pool now (``pagoda simulate`` counts the preemptions
        that swapped). Optional: False for every sequence, as for an allocator that never swaps."""


@runtime_checkable
class KVOffloadTiers(Protocol):
    """The optional offload-tier members of a KV allocator (``--kv-offload-*``, docs/kv_offload.md), as
    :class:`pagoda.kv.tiers.TieredPrefixCache` has them. Core uses them only on an allocator whose class
    defines ``take_tier_moves`` (:func:`has_offload_tiers`)."""

    tiers: Optional["KVTierIndex"]  # the tiers' books; None while off

    def init_offload(self, tiers: "KVTierIndex") -> None:
        """Keep evicted prefix blocks in these tiers (the runner's tier store holds the matching memory)."""

    def take_tier_moves(self) -> "KVTierMoves":
        """Tier moves decided since the last call, for the scheduler to pass to the runner with the step."""

    def drop_failed_loads(self, block_hashes: Iterable[int]) -> None:
        """Forget tier blocks the runner found corrupt when loading them (it recomputed their tokens)."""

    def spill_to_disk(self) -> "KVTierMoves":
        """The moves writing every prefix block held in RAM or in the pool to the disk tier, called when the
        engine shuts down so that the next engine on the directory finds them. Optional: no moves (the disk
        tier keeps what it already holds)."""


@runtime_checkable
class KVWindowSlots(Protocol):
    """The members of a KV allocator that keeps window slots (``--kv-window-pool``, docs/models.md), as
    :class:`pagoda.kv.window.WindowSlots` has them. Core uses them only on an allocator whose class defines
    ``init_window_pool``; an engine whose model would take the window pool refuses an allocator without it."""

    window: Optional[int]  # the pool's window; None while off
    window_usage: float  # fraction of the window slots requests' windows hold (0 while off)

    def init_window_pool(self, num_slots: int, window: int) -> None:
        """Keep ``num_slots`` window slots (numbered from 1; slot 0 is never handed out) for blocks within
        ``window`` tokens of a request's next position, and count them in ``can_allocate``."""

    def window_block_table(self, request_id: str) -> list[int]:
        """The sequence's block table in the window pool: each block's slot, 0 for those out of its window."""

    def take_window_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write moves in the window pool ``(source slot, copy's slot)`` decided since the last call."""


def has_window_slots(kv_manager: Any) -> bool:
    """Whether a KV allocator offers the :class:`KVWindowSlots` members. Asked of its class (does it define
    ``init_window_pool``), like :func:`has_offload_tiers`."""
    return callable(getattr(type(kv_manager), "init_window_pool", None))


def has_offload_tiers(kv_manager: Any) -> bool:
    """Whether a KV allocator offers the optional :class:`KVOffloadTiers` members. Asked of its class (does it
    define ``take_tier_moves``), so an allocator that lacks them is never touched outside its Protocol."""
    return callable(getattr(type(kv_manager), "take_tier_moves", None))


@runtime_checkable
class Scheduler(Protocol):
    """What the engine calls on its scheduler, :class:`pagoda.scheduling.Scheduler` (core, not a plugin kind: a
    ``pagoda_schedulers`` plugin supplies its policy, :class:`pagoda.scheduling.SchedulingPolicy`): which
    sequences run each step and how many tokens each, and the one writer of their progress.

    Invariants: a step's ``SchedulerOutput`` never exceeds ``max_num_batched_tokens`` tokens nor
    ``max_num_seqs`` running sequences; a sequence appears in a step at most once; ``schedule`` decides
    and records its decisions in the ``SchedulerOutput`` (each request's start position, preemptions,
    swaps, failures) and writes no sequence's progress (``num_computed_tokens``, tokens, logprobs, an
    end); ``update`` commits the step, so a step whose execution fails can be rolled back; every
    finished sequence holds no KV block.
    """

    running: list["Sequence"]
    waiting: list["Sequence"]
    num_preemptions: int
    # the KV allocator the scheduler was built with (its factory's ``kv_manager``); the conformance kit checks
    # the scheduler's block tables against it
    kv: KVCacheManager

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_swapped(self) -> int: ...

    def add_request(self, request: "Sequence") -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def schedule(self) -> "SchedulerOutput":
        """The next step's batch (prefill chunks, decodes, draft slots), block moves and preemptions."""

    def schedule_excluding(self, busy: typing.Container[str]) -> "SchedulerOutput":
        """(1.8) The next step's batch as :meth:`schedule` makes it, leaving alone every sequence whose request
        id is in ``busy``: none of them is scheduled, admitted, swapped, preempted or failed, and their blocks
        stay as they are. Under pipeline parallelism the engine keeps steps in flight and calls this with the
        sequences of those steps (and of the other steps' share of the work) busy; each step is then updated,
        in the order scheduled, with :meth:`update` as usual."""

    def update(self, sched: "SchedulerOutput", result: "RunnerOutput") -> list["Sequence"]:
        """Commit the step, the only place a sequence's progress moves: its computed tokens (the
        step's known tokens plus accepted drafts, from ``sched.num_computed_before``), the tokens it
        appends (``result.sampled_token_ids[i]``, through ``Sequence.append_output_tokens``, which
        applies the stop conditions), logprobs; a sequence preempted by recompute computes again from
        0; ``sched.failed`` and ``result.failed`` end with their errors (:meth:`fail`); finished
        sequences are freed. A prefill-only sequence (``Sequence.is_prefill_only``, ``max_tokens=0``)
        finishes once its prompt is computed, through ``append_output_tokens``, and gains no token.
        Returns the sequences that gained tokens."""

    def rollback(self, sched: "SchedulerOutput") -> None:
        """Undo what a step whose execution failed may have left half done (block moves, prefix-cache
        entries for uncomputed blocks); no sequence loses a token. ``sched.failed`` still ends."""

    def finish(self, request: "Sequence", status: "SequenceStatus") -> None:
        """End a sequence in any state and free its blocks at once."""

    def fail(self, request: "Sequence", error: str) -> None:
        """End a sequence for an error (``request.error``: what was wrong and how to fix it) through
        :meth:`finish` with ``FINISHED_ERROR``; the engine ends failed sequences only through this."""

    def abort_requests(self, request_ids: Iterable[str]) -> list["Sequence"]: ...

    def drain_finished(self) -> list["Sequence"]:
        """Sequences finished since the last call."""


@runtime_checkable
class AttentionBackend(Protocol):
    """``pagoda_attention_backends``: K/V layout, per-step metadata, the attention kernel."""

    # the dtype the cache tensors hold (None: the model's); the engine refuses one that differs from
    # what ``kv_cache_dtype`` asked for. Optional: None.
    kv_cache_dtype: Optional["torch.dtype"]
    # the backend's name in messages. Optional: the name it was selected by (``attention_backend``).
    name: str
    # the attention features beyond causal attention it implements (``sliding_window``, ``logit_softcap``,
    # ``sinks``); a model asking for another is refused at start-up. Optional: none.
    attention_features: frozenset
    # True if, as built (``model_config.batch_invariant`` on), a query token's output bits depend only on its
    # own query and keys: not on the other tokens of the step, their number, nor which keys were cached. The
    # engine's batch-invariant mode refuses a backend without it. Optional: False.
    batch_invariant: bool

    def isa_paths(self) -> dict[str, str]:
        """Which code path each of its CPU kernels takes here (``{"decode attention": "avx2"}``), as the
        benchmarks report it. Optional: ``{}``."""

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's KV tensor; exactly one axis grows with ``num_blocks``."""

    def build_metadata(self, batch: "AttentionBatch") -> Any:
        """Called once per step; the result is handed to every layer's ``forward``."""

    def forward(self, layer: Any, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                kv_cache: "torch.Tensor", metadata: Any) -> "torch.Tensor":
        """Write this step's K/V into their slots and attend: ``[T, H, D]`` q -> ``[T, H * D]``.

        ``layer.scale`` is the softmax scale; the cache tensors hold ``kv_cache_dtype`` (the model's dtype
        when it is None).
        """


@runtime_checkable
class Sampler(Protocol):
    """``pagoda_samplers``: logits of the sequences to sample -> one token id each (and logprobs).

    Invariants: a token of ``Sequence.banned_token_ids()`` is never drawn; a greedy row takes its argmax
    (after bias and penalties); a sequence with a seed draws the same tokens whatever else is in the batch;
    logprobs are those of the model's raw distribution. ``pagoda.testing.check_sampler`` checks them.
    """

    # True if tokens follow exactly the distribution the sampling parameters describe (bias, bans,
    # penalties, temperature, top-k, top-p, min-p). Speculative decoding verifies drafts with pagoda's
    # rejection sampler, which reproduces that distribution, so the engine refuses speculation with a
    # sampler that says False. Optional: False.
    samples_standard_distribution: bool
    # True if a row's token and logprobs depend only on that row's logits and its request (a seeded request's
    # own generator), not on the other rows; the engine's batch-invariant mode refuses a sampler without it.
    # Optional: False.
    batch_invariant: bool

    def __call__(self, logits: "torch.Tensor", requests: typing.Sequence["Sequence"]) -> "SamplerOutput":
        """``logits [n, vocab]`` float32, row ``i`` for ``requests[i]`` (the sampler may not change them) ->
        ``SamplerOutput(token_ids, logprobs)``: ``logprobs[i]`` when ``requests[i]`` asked for them."""


@runtime_checkable
class StructuredOutputMatcher(Protocol):
    """One sequence's place in its grammar (from :meth:`StructuredOutputBackend.new_matcher`).

    The bitmask is int32 ``[rows, ceil(vocab / 32)]``: token ``t`` is allowed in row ``r`` when bit ``t % 32``
    of ``bitmask[r, t // 32]`` is set. The engine's end-of-sequence tokens are allowed exactly where the grammar
    may end. The engine fills a row before each step the sequence samples in, advances the matcher with the
    tokens it commits (``Sequence.append_output_tokens``) and never twice for the same token. Under
    speculative decoding the runner also fills the rows after each draft of the step: it accepts the drafts
    one by one and then rolls all of them back, so the matcher stands at the committed tokens between steps.
    """

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (every bit of the row)."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (the matcher unchanged) if the grammar refuses any of them."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a step's speculative drafts; an accepted end-of-sequence
        token among them too)."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its end (nothing may follow)."""

    def may_end(self) -> bool:
        """True when the tokens accepted so far are a complete match (an end-of-sequence token is allowed)."""

    def fork(self) -> Optional["StructuredOutputMatcher"]:
        """A new matcher at this one's place in the grammar, advanced and rolled back independently of it; None
        if this matcher cannot be copied (1.8). A draft model steers its speculative drafts with a fork of each
        sequence's matcher and drops the fork after drafting. Optional: a matcher without it (its backend's
        ``new_matcher`` made it) gets one returning None, and its drafts are proposed unconstrained
        (verification still masks them: only their acceptance suffers)."""


@runtime_checkable
class StructuredOutputBackend(Protocol):
    """``pagoda_structured_output_backends``: compiles output constraints for the model's tokenizer.

    ``compile`` may run on a thread of the engine's compile pool while the engine steps; the compiled grammar
    it returns is shared by every sequence (and request) with the same constraint, each with its own matcher.
    A backend whose compile can be stopped may also offer ``compile_until(spec, should_stop)``, which the engine
    then calls instead: it gives up (raising
    :class:`pagoda.sampling.structured.compile_process.CompileStopped`) once ``should_stop(seconds spent
    compiling)`` is true, which happens past the compile timeout or when no request waits any more; without it
    a compile runs to its end.
    ``pagoda.testing.check_structured_output_backend`` checks a backend.
    """

    def supports(self, spec: "StructuredOutputsParams") -> Optional[str]:
        """None if this backend can compile ``spec``; else why not, in a sentence (``auto`` then tries the
        next backend; a request that names this backend gets the reason as its error)."""

    def compile(self, spec: "StructuredOutputsParams") -> Any:
        """The compiled grammar of ``spec``; raises :class:`pagoda.errors.InvalidRequestError` naming the
        field (``structured_outputs.json`` and the like) and what is wrong for a schema, regex or grammar that
        does not compile."""

    def new_matcher(self, compiled: Any) -> StructuredOutputMatcher:
        """A fresh matcher at the start of ``compiled`` (what :meth:`compile` returned)."""


@runtime_checkable
class Proposer(Protocol):
    """``pagoda_proposers``: draft tokens for speculative decoding."""

    def propose(self, sched: "SchedulerOutput") -> tuple[list[list[int]], list[Optional["torch.Tensor"]]]:
        """Called by the runner every step before the target's forward pass.

        For each ``sched.requests[i]``: at most ``sched.num_draft_slots[i]`` draft token ids (a
        sequence with slots is decoding, and its blocks hold room for them after its last token), and
        the ``[num_drafts, vocab]`` probabilities they were drawn from (None: each draft is a point
        mass, as for n-gram lookup). A proposer with its own KV cache also computes the step's other
        scheduled tokens here.
        """


@runtime_checkable
class Executor(Protocol):
    """``pagoda_executors``: runs each step on every rank of the model; the driver alone schedules.

    Invariants: every rank runs the same steps in the same order, with the same sequences' tokens; the
    result is rank 0's (under pipeline parallelism, ``config.parallel.world_size`` ranks: the last stage's
    first rank's); a step's block moves happen on every rank before its execution. An executor may add
    ``stage_stats()`` (every rank's :func:`pagoda.execution.pipeline.stats_snapshot`), which ``--profile``
    reads for its per-stage table.
    """

    # rank 0's runner (the whole model without tensor parallelism)
    runner: "ModelRunnerView"

    def execute(self, sched: "SchedulerOutput") -> "RunnerOutput":
        """Run the step on every rank (``ModelRunner.execute``); rank 0's result."""

    def move_blocks(self, sched: "SchedulerOutput") -> Optional[list[int]]:
        """Perform the step's swaps, offload-tier moves and copies on every rank. Returns the block hashes of
        tier loads that failed their check on any rank (``ModelRunner.move_blocks``), or None/empty."""

    def submit(self, sched: "SchedulerOutput") -> Any:
        """(1.8) Start the step on every rank and return a handle for :meth:`collect` once the first pipeline
        stage has run it, so that the engine can schedule and submit the next step while the later stages run
        this one. Steps run on every rank in the order submitted; a block move (:meth:`move_blocks`) made
        between two submits runs on every rank between those steps. Optional (executors are not adapted: the
        engine reads a missing one as None): None, and the engine calls :meth:`execute`, one step at a time."""

    def collect(self, handle: Any) -> "RunnerOutput":
        """(1.8) The result of a step started with :meth:`submit`, as :meth:`execute` returns it (raises what
        its execution raised); the engine collects steps in the order it submitted them. An :meth:`execute`
        call between a submit and its collect is allowed and runs after the steps submitted. Optional: None."""

    def shutdown(self) -> None:
        """Stop the other ranks; the executor runs nothing after it."""


@runtime_checkable
class ModelRunnerView(Protocol):
    """What the engine and the built-in commands read off :attr:`Executor.runner`, rank 0's model runner
    (:class:`pagoda.execution.model_runner.ModelRunner`, which a custom executor builds with
    ``pagoda.execution.build.build_runner``)."""

    model: CausalLM
    backend: AttentionBackend
    num_blocks: int  # KV blocks its cache tensors hold, which the KV allocator hands out
    num_swap_blocks: int  # blocks of its CPU swap space (0: none)
    # the offload tiers' tensors and files (``pagoda.kv.offload.KVTierStore``), None without ``--kv-offload-*``
    kv_tiers: Optional["KVTierStore"]
    # how the KV memory is split when sliding-window layers keep only their window (``--kv-window-pool``), None
    # when every layer keeps every token
    window_pool: Optional["WindowPoolPlan"]
    timings: dict[str, float]  # seconds of each phase of the last step it ran (``--profile``)
    lora: Any  # its LoRA adapters (a pagoda.execution.lora.LoRAManager), None when LoRA is off

    def allocate_swap_space(self, num_swap_blocks: int) -> None:
        """(Re)size the CPU swap space to ``num_swap_blocks`` blocks."""

    def move_blocks(self, sched: "SchedulerOutput") -> list[int]:
        """Perform the step's swaps, tier moves and copies on this rank (see :meth:`Executor.move_blocks`)."""


@runtime_checkable
class AllReduce(Protocol):
    """``pagoda_all_reduce_backends``: the collectives joining the ranks of a tensor-parallel model.

    Invariants: every rank calls the same collectives in the same order with tensors of the same shape and
    dtype; the results are identical on every rank (a sum adds the parts in the same order everywhere).
    """

    def all_reduce(self, x: "torch.Tensor") -> None:
        """Replace ``x`` with the sum of every rank's ``x``, in place."""

    def all_gather(self, x: "torch.Tensor") -> "list[torch.Tensor]":
        """Every rank's ``x``, in rank order (new tensors; ``x`` is unchanged)."""

    def close(self) -> None:
        """Release what the backend holds; called once on every rank when the engine shuts down."""


@runtime_checkable
class KVConnector(Protocol):
    """``pagoda_kv_connectors``: a store outside the engine holding full prompt blocks' K/V, by key.

    A connector moves opaque byte strings; pagoda decides what to save and load, frames each block with its
    tokens, the configuration's fingerprint and a crc32, and trusts nothing it loads: a value that is
    missing, short, of another block or fails its checksum is dropped and the block recomputed. Keys are
    ``<32 hex digits: the configuration's fingerprint>-<16 hex digits: the block's chain hash>``, the same
    in every engine of one model, dtype, KV layout and block size.

    Threads: :meth:`lookup` is called on the engine's loop at admission (keep it quick: it holds up the
    step); :meth:`load` and :meth:`save` on pagoda's connector threads, several at once, so they must be
    thread-safe. None may raise for a store that is down or slow to answer: an exception counts as a miss
    (a failed save is logged and dropped). Invariant: a key, once saved, always holds the same bytes or
    nothing (a reader sees a whole value or none).
    """

    def lookup(self, keys: "typing.Sequence[str]") -> int:
        """How many of ``keys``, from the first, the store holds now (0 to ``len(keys)``): the blocks of a
        prompt, in order, beyond those the engine's own cache has."""

    def load(self, key: str) -> Optional[bytes]:
        """The bytes saved under ``key``, or None if there are none."""

    def save(self, key: str, value: bytes) -> None:
        """Keep ``value`` under ``key`` (readers never see it half written)."""

    def close(self) -> None:
        """Release what the connector holds; called once when the engine shuts down, after every save."""


@runtime_checkable
class Router(Protocol):
    """``pagoda_routers``: picks the engine replica for each request (plain bookkeeping, no I/O).

    Invariants: ``route`` returns one of the given replicas and changes nothing; ``on_routed`` is called
    once for every request as soon as its replica is known, before the next request is routed.
    """

    def route(self, request: "RoutingRequest", replicas: "typing.Sequence[ReplicaLoad]") -> "RoutingDecision":
        """The replica for ``request`` among ``replicas`` (never empty), and why."""

    def on_routed(self, request: "RoutingRequest", replica_id: typing.Hashable) -> None:
        """Record that ``request`` was sent to ``replica_id``."""

    def on_replica_removed(self, replica_id: typing.Hashable) -> None:
        """Forget a replica that stopped."""


@runtime_checkable
class LinearMethod(Protocol):
    """What a linear layer asks of its quant method (see ``pagoda.modeling.layers.linear``)."""

    def create_weights(self, layer: Any, dtype: "torch.dtype") -> None:
        """Register the layer's parameters (packed shapes), each with a ``weight_loader``."""

    def process_weights_after_loading(self, layer: Any) -> None: ...

    def apply(self, layer: Any, x: "torch.Tensor", bias: Optional["torch.Tensor"]) -> "torch.Tensor": ...


@runtime_checkable
class QuantMethod(Protocol):
    """``pagoda_quant_methods``: decides, per linear layer, how its weights are stored and applied."""

    def for_layer(self, prefix: str) -> Optional[LinearMethod]:
        """The method for the layer named ``prefix`` (checkpoint naming), or None for dense weights."""


@runtime_checkable
class LoRABackend(Protocol):
    """``pagoda_lora_backends`` (1.6): adds the LoRA terms of a batch's adapters to a linear layer's output.

    Every adapter of the step is applied in one call, segmented by adapter (Punica's shrink then expand): for
    each token ``t`` with slot ``s = batch.token_slots[t] >= 0``, ``y[t] += lora_b[s] @ (lora_a[s] @ x[t])``;
    rows of base-model tokens (slot -1) are left exactly as they are. The adapter's scaling is already in
    ``lora_b``, and a slot's unused rank rows are zero. ``pagoda.testing.check_lora_backend`` checks a backend.
    """

    def apply(self, y: "torch.Tensor", x: "torch.Tensor", lora_a: "torch.Tensor", lora_b: "torch.Tensor",
              batch: "LoRABatch") -> None:
        """``y [num_tokens, out]`` (updated in place), ``x [num_tokens, in]``, ``lora_a [max_loras, rank, in]``,
        ``lora_b [max_loras, out, rank]``, all of the model's dtype."""


@runtime_checkable
class ToolParser(Protocol):
    """``pagoda_tool_parsers``: finds the tool calls in the text of one answer (a new parser per answer).

    Invariants: reading a text as a stream, split anywhere, gives what reading it whole gives: the content
    pieces joined are the whole read's ``content`` (``""`` for None), and per call the first delta carries
    its id and name, the ``arguments`` fragments joined are its arguments, and indices count from 0 in the
    order the calls begin (:func:`pagoda.tool_calls.join_deltas` puts a stream together). Each call's id is
    unique; its ``arguments`` are JSON. A text with no call comes back whole as content.
    ``pagoda.testing.check_tool_parser`` checks these on examples of the parser's format.
    """

    def extract_tool_calls(self, model_output: str) -> "ExtractedToolCalls":
        """The whole text of an answer -> its content and calls. Independent of any streaming read."""

    def extract_tool_calls_streaming(self, delta_text: str) -> "DeltaMessage":
        """The next piece of the answer's text -> what it adds (empty while the parser holds text back to
        decide whether it starts a call)."""

    def finish_streaming(self) -> "DeltaMessage":
        """The answer ended: what was held back, as content or as the end of the last call."""


@runtime_checkable
class ReasoningParser(Protocol):
    """``pagoda_reasoning_parsers``: splits the text of one answer into thinking and answer (a new parser per
    answer, made for the prompt the answer continues).

    Invariants: reading a text as a stream, split anywhere, gives what reading it whole gives (the pieces
    joined); no tag or channel marker of the format reaches either part. ``skip_special_tokens`` False: the
    format's markers are special tokens, so the server decodes the answer with them kept.
    ``pagoda.testing.check_reasoning_parser`` checks these on examples of the parser's format.
    """

    skip_special_tokens: bool

    def extract_reasoning(self, model_output: str) -> "ReasoningDelta":
        """The whole text of an answer -> its thinking and its answer. Independent of any streaming read."""

    def extract_reasoning_streaming(self, delta_text: str) -> "ReasoningDelta":
        """The next piece of the answer's text -> what it adds (empty while the parser holds back text that may
        begin a tag)."""

    def finish_streaming(self) -> "ReasoningDelta":
        """The answer ended: what was held back."""

    def reasoning_end(self, token_ids: "typing.Sequence[int]", tokenizer: Any) -> Optional[int]:
        """Optional (0.10): the answer's ids so far (called again as they grow) -> how many of its first ids the
        thinking takes, its end marker included (0: the answer has no thinking), or None while it goes on. Once
        it has ended in some ids it ends at the same place in any longer ones. The engine starts a request's
        constraint there (docs/reasoning.md); a parser without it cannot start one after the thinking."""


# --------------------------------------------------------------------------
# Factories: what each hook's ``{name: factory}`` mapping holds. A class whose ``__init__`` takes these
# arguments is a factory; so is a function.
# --------------------------------------------------------------------------


class ModelLoaderFactory(Protocol):
    def __call__(self, model_config: "ModelConfig") -> ModelLoader: ...


class ModelArchitectureFactory(Protocol):
    """The model class. With ``supports_tensor_parallel = True`` it builds the rank's shard that
    ``pagoda.execution.distributed.current()`` describes; without it the engine refuses more than one rank.
    With ``supports_pipeline_parallel = True`` (1.7) it builds only the layers of the pipeline stage
    ``pagoda.execution.distributed.current_stage()`` describes, and its ``forward`` takes ``intermediate``
    (the previous stage's ``(hidden_states, residual)``) and returns its own pair before the last stage;
    without it the engine refuses more than one stage."""

    def __call__(self, model_config: "ModelConfig", attention_backend: AttentionBackend,
                 quant_method: Optional[QuantMethod]) -> CausalLM: ...


class KVAllocatorFactory(Protocol):
    def __call__(self, cache_config: "CacheConfig", num_blocks: int) -> KVCacheManager: ...


class KVConnectorFactory(Protocol):
    """``options``: the ``kv_connector_options`` JSON object, as keyword arguments; a wrong or missing
    option raises ``ValueError`` naming it."""

    def __call__(self, engine_config: "EngineConfig", **options: Any) -> KVConnector: ...


class SchedulerFactory(Protocol):
    """A ``pagoda_schedulers`` component: ``factory(scheduler, **options)`` returns the policy whose hooks
    ``scheduler`` calls (a :class:`pagoda.scheduling.SchedulingPolicy`; its hooks, when each is called and its
    default are documented there); ``options`` are ``scheduler_options``. A ``ValueError`` from it names the
    option that is wrong."""

    def __call__(self, scheduler: Scheduler, **options: Any) -> "SchedulingPolicy": ...


class AttentionBackendFactory(Protocol):
    """Raises :class:`pagoda.errors.BackendUnavailable` when it cannot run here. May carry
    ``auto_priority: dict[str, int]`` (device -> rank) to be a candidate for ``attention_backend=auto``."""

    def __call__(self, model_config: "ModelConfig", cache_config: "CacheConfig") -> AttentionBackend: ...


class SamplerFactory(Protocol):
    def __call__(self, model_config: "ModelConfig") -> Sampler: ...


class StructuredOutputBackendFactory(Protocol):
    """``tokenizer`` is the engine's Hugging Face tokenizer; ``eos_token_ids`` the tokens that end a sequence
    (allowed where the grammar may end). Raises :class:`pagoda.errors.BackendUnavailable` when the backend's
    library is not installed."""

    def __call__(self, model_config: "ModelConfig", tokenizer: Any, eos_token_ids: list[int]
                 ) -> StructuredOutputBackend: ...


class LoRABackendFactory(Protocol):
    def __call__(self, lora_config: "LoRAConfig", model_config: "ModelConfig") -> LoRABackend: ...


class QuantMethodFactory(Protocol):
    """``quant_config`` is the checkpoint's ``quantization_config`` (empty for online quantization)."""

    def __call__(self, model_config: "ModelConfig", quant_config: dict) -> QuantMethod: ...


class ProposerFactory(Protocol):
    """``runner`` is the :class:`pagoda.execution.model_runner.ModelRunner` (a draft model shares its KV block ids and
    may register its own caches with ``runner.add_draft_kv_caches``); ``plugin_manager`` resolves a draft
    checkpoint's architecture and loader."""

    def __call__(self, speculative_config: "SpeculativeConfig", engine_config: "EngineConfig", runner: Any,
                 plugin_manager: "PluginManager") -> Proposer: ...


class ExecutorFactory(Protocol):
    def __call__(self, engine_config: "EngineConfig", plugin_manager: "PluginManager") -> Executor: ...


class AllReduceFactory(Protocol):
    """Called on every rank after torch.distributed joined them (``group``); raises
    :class:`pagoda.errors.BackendUnavailable` on every rank alike when it cannot run (``auto`` then tries the
    next backend)."""

    def __call__(self, engine_config: "EngineConfig", rank: int, size: int, group: Any,
                 timeout_seconds: float) -> AllReduce: ...


class RouterFactory(Protocol):
    def __call__(self, **options: Any) -> Router: ...


class CLICommand(Protocol):
    """Adds one sub-parser to ``subparsers`` and sets its ``func`` default to ``func(args) -> exit code``."""

    def __call__(self, subparsers: "argparse._SubParsersAction") -> None: ...


class ToolParserFactory(Protocol):
    """``tools``: the request's function tools in OpenAI's shape (``{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}``)."""

    def __call__(self, tools: list[dict]) -> ToolParser: ...


class ReasoningParserFactory(Protocol):
    """``prompt``: the text of the rendered prompt the answer continues (a template may open the thinking, or
    close it when thinking is switched off)."""

    def __call__(self, prompt: str) -> ReasoningParser: ...
