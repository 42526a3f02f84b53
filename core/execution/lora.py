"""Multi-LoRA serving on the runner's side: adapters in memory, their slots in the stacked weights, and the
per-pass slot index every adapted layer reads.

Each adaptable linear layer of the model gets a :class:`LoRALayer` (its ``lora`` attribute) holding stacked
weights for ``max_loras`` slots: ``lora_a [max_loras, S * R, in]`` and ``lora_b [max_loras, out, S * R]``,
where ``S`` is the layer's output slices (3 for fused QKV) and ``R`` the engine's ``max_lora_rank``. Slice ``i``
of an adapter occupies rank rows ``[i * R, i * R + r)`` of A and the matching columns of B in its own output
rows only, so one shrink and one expand compute every slice. A slot is empty (zeros) where its adapter does
not adapt a layer.

Under tensor parallelism each rank holds its shard of every adapter, cut as the layer's base weight is: a
column-parallel layer (QKV, gate/up) keeps A whole and the rows of B its output rows are (per slice, with the
head sharding of the base weight); a row-parallel one (o_proj, down_proj) keeps the input columns of A its
weight has and B whole, and adds its partial term before the layer's all-reduce, which sums them into the
whole term.

The books are rank 0's: its :class:`LoRAManager` keeps the adapters in memory and decides which slot each
adapter of a step takes. :meth:`LoRAManager.plan` returns that as a :class:`LoRAStep` (the slot of each
request, and the adapters written into slots since the last step); the executor sends it with the step, and
the other ranks' :class:`LoRAFollower` copy the same adapters into the same slots. Every rank's
:class:`LoRASlots` then sets the :class:`pagoda.step.LoRABatch` all its layers read, and the backend adds every
adapter's terms in one call per layer.
"""

from __future__ import annotations

import logging
import typing
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.execution.lora_adapter import LoRAAdapter, LoRATarget, load_adapter
from pagoda.execution.lora_request import LoRARequest
from pagoda.step import LoRABatch

logger = logging.getLogger("pagoda")


class LoRAPass:
    """What every adapted layer reads during one forward pass: the pass's :class:`LoRABatch`, or None when
    no token of the pass uses an adapter (the layers then add nothing)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


@dataclass
class LoRAStep:
    """Rank 0's adapter decisions for one step, which every other rank applies as they are.

    ``slots[i]``: the slot request ``i`` of the step uses (-1: the base model); ``writes``: slot -> the adapter
    rank 0 copied into it since the last step it planned (None: the slot was emptied), the later write of a
    slot replacing the earlier."""

    slots: list[int]
    writes: dict[int, Optional[LoRAAdapter]] = field(default_factory=dict)


class LoRALayer:
    """One linear layer's adapter slots, this rank's shard of them; ``add(x, y)`` adds the pass's LoRA terms to
    ``y`` in place.

    ``module``: the layer (``in_features`` and ``output_sizes`` this rank's; ``tp_rows``: per output slice the
    ``(start, size)`` rows it holds under column parallelism; ``tp_cols``: the ``(start, size)`` input columns
    under row parallelism; None when not sharded that way)."""

    def __init__(self, module: Any, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 current: LoRAPass, backend: Any) -> None:
        self.output_sizes = list(module.output_sizes)
        self.tp_rows = module.tp_rows
        self.tp_cols = module.tp_cols
        self.rank = config.max_lora_rank
        num_slices, out = len(self.output_sizes), sum(self.output_sizes)
        self.lora_a = torch.zeros(config.max_loras, num_slices * self.rank, module.in_features, dtype=dtype,
                                  device=device)
        self.lora_b = torch.zeros(config.max_loras, out, num_slices * self.rank, dtype=dtype, device=device)
        self.current = current
        self.backend = backend

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.current.batch
        if batch is not None:
            self.backend.apply(y, x, self.lora_a, self.lora_b, batch)
        return y

    def set_slot(self, slot: int, a: list[Optional[torch.Tensor]], b: list[Optional[torch.Tensor]]) -> None:
        """Write this rank's shard of one adapter's slices into ``slot`` (zeros where it has none); a: ``[r, in]``,
        b: ``[out_i, r]``, whole (as the checkpoint's projections are)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        start = 0
        for i, size in enumerate(self.output_sizes):
            if a[i] is not None:  # rank r <= R: load_adapter refuses larger ones
                a_i = a[i] if self.tp_cols is None else a[i].narrow(1, *self.tp_cols)  # row parallel: my columns
                b_i = b[i] if self.tp_rows is None else b[i].narrow(0, *self.tp_rows[i])  # column parallel: my rows
                cols = slice(i * self.rank, i * self.rank + a_i.shape[0])
                self.lora_a[slot, cols].copy_(a_i)
                self.lora_b[slot, start:start + size, cols].copy_(b_i)
            start += size

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


class LoRASlots:
    """One rank's adapter slots in every adaptable layer of its model, and the slot index of the current pass.
    Keeps no books: which adapter a slot holds is for rank 0's :class:`LoRAManager` to say."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, model: torch.nn.Module, backend: Any,
                 device: torch.device) -> None:
        if not getattr(model, "supports_lora", True):
            raise ConfigError(f"{model_config.architecture} is a Mixture-of-Experts model, whose experts pagoda does "
                              "not adapt with LoRA yet; drop --enable-lora")
        self.config = config
        self.current = LoRAPass()
        # the model's fused layers and the checkpoint projections each stacks (vLLM's packed_modules_mapping)
        self.packed: dict[str, list[str]] = dict(model.packed_modules_mapping)
        self.layers: dict[str, LoRALayer] = {}
        # each adaptable layer's whole shape (before tensor-parallel sharding): what an adapter is checked against
        self.targets: dict[str, LoRATarget] = {}
        for module in model.modules():
            prefix = getattr(module, "prefix", None)
            if not hasattr(module, "lora") or not prefix or not _is_adaptable(prefix, self.packed):
                continue
            self.targets[prefix] = LoRATarget(module.full_in_features, tuple(module.full_output_sizes))
            module.lora = self.layers[prefix] = LoRALayer(module, config, model_config.dtype, device, self.current,
                                                          backend)
        if not self.layers:
            raise ConfigError(f"{model_config.architecture} has no linear layer LoRA can adapt; drop --enable-lora")

    def write(self, slot: int, adapter: Optional[LoRAAdapter]) -> None:
        """Copy ``adapter`` into ``slot`` of every layer (this rank's shard; zeros in the layers it leaves
        alone), or empty the slot (None)."""
        for prefix, layer in self.layers.items():
            if adapter is not None and prefix in adapter.lora_a:
                layer.set_slot(slot, adapter.lora_a[prefix], adapter.lora_b[prefix])
            else:
                layer.clear_slot(slot)

    def begin_pass(self, slots: typing.Sequence[int], token_counts: typing.Sequence[int],
                   order: typing.Sequence[int]) -> None:
        """Set the slot index of a pass whose request ``i`` uses slot ``slots[i]`` (-1: the base model) for
        ``token_counts[i]`` tokens, laid out in ``order`` (the batch's rows: request ``order[0]``'s tokens
        first)."""
        if all(s < 0 for s in slots):
            self.current.batch = None
            return
        token_slots = torch.repeat_interleave(torch.tensor([slots[i] for i in order], dtype=torch.int64),
                                              torch.tensor([token_counts[i] for i in order], dtype=torch.int64))
        self.current.batch = LoRABatch.from_token_slots(token_slots)

    def end_pass(self) -> None:
        self.current.batch = None


class LoRAManager:
    """Rank 0's adapters: up to ``max_cpu_loras`` loaded in memory (least recently used evicted) and up to
    ``max_loras`` of them in slots, the ones the current pass's requests use. Keeps no request state.

    The adapters in memory are whole; each rank's :class:`LoRASlots` cuts its shard when it copies one into a
    slot. An adapter is read and checked here only, once, so a bad one is refused before any rank sees it."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, slots: LoRASlots) -> None:
        self.config = config
        self.dtype = model_config.dtype
        self.slots = slots
        self.packed = slots.packed
        self.targets = slots.targets
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, oldest use first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, oldest use first
        self._free_slots = list(range(config.max_loras))
        # slot -> what was copied into it since the last plan (None: emptied), for the other ranks
        self._writes: dict[int, Optional[LoRAAdapter]] = {}

    # ---- adapters in memory ----------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter ``request`` names, loaded and checked (from memory if it is there). Raises
        :class:`InvalidRequestError` saying what is wrong with the adapter, or that its id is taken."""
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is not None:
            if adapter.request != request:
                raise InvalidRequestError(
                    f"LoRA id {request.lora_int_id} is already adapter {adapter.request.lora_name!r} "
                    f"({adapter.request.lora_path}); give {request.lora_name!r} an id of its own")
            self._loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.targets, self.packed, self.config.max_lora_rank, self.dtype)
        self._release_slot(request.lora_int_id)  # an evicted adapter's slot may hold another adapter of this id
        self._loaded[request.lora_int_id] = adapter
        while len(self._loaded) > self.config.max_cpu_loras:
            evicted, _ = self._loaded.popitem(last=False)
            logger.info("LoRA adapter %d evicted from memory (--max-cpu-loras %d)", evicted,
                        self.config.max_cpu_loras)
        logger.info("LoRA adapter %r loaded (id %d, rank %d, scaling %g)", request.lora_name, request.lora_int_id,
                    adapter.rank, adapter.scaling)
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (memory and slot); False if it was not loaded."""
        found = self._loaded.pop(lora_int_id, None) is not None
        return self._release_slot(lora_int_id) or found

    def _release_slot(self, lora_int_id: int) -> bool:
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is None:
            return False
        self._write(slot, None)
        self._free_slots.append(slot)
        return True

    def _write(self, slot: int, adapter: Optional[LoRAAdapter]) -> None:
        self.slots.write(slot, adapter)
        self._writes[slot] = adapter

    def loaded_ids(self) -> list[int]:
        return list(self._loaded)

    # ---- a step ----------------------------------------------------------------------------

    def plan(self, lora_requests: typing.Sequence[Optional[LoRARequest]]) -> LoRAStep:
        """The slot of each request of a step (``lora_requests[i]``, None for the base model), loading adapters
        into slots as needed, with every slot write since the last plan: what the other ranks apply. Planning
        the same step again changes no slot."""
        wanted = [r for r in lora_requests if r is not None]
        slot_of = self._assign_slots(wanted) if wanted else {}
        step = LoRAStep([-1 if r is None else slot_of[r.lora_int_id] for r in lora_requests], self._writes)
        self._writes = {}
        return step

    def begin_pass(self, lora_requests: typing.Sequence[Optional[LoRARequest]], token_counts: typing.Sequence[int],
                   order: typing.Sequence[int]) -> None:
        """Set the slot index of a pass whose request ``i`` (``lora_requests[i]``, None for the base model)
        computes ``token_counts[i]`` tokens, laid out in ``order`` (the batch's rows: request ``order[0]``'s
        tokens first). Loads adapters into slots as needed."""
        self.slots.begin_pass(self.plan(lora_requests).slots, token_counts, order)

    def end_pass(self) -> None:
        self.slots.end_pass()

    def _assign_slots(self, requests: list[LoRARequest]) -> dict[int, int]:
        wanted: dict[int, LoRARequest] = {}
        for r in requests:
            wanted.setdefault(r.lora_int_id, r)
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters, more than --max-loras "
                               f"{self.config.max_loras}: the scheduler must not admit more adapters at once")
        for lora_id in wanted:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id in self._slot_of:
                continue
            adapter = self.add_adapter(request)
            if self._free_slots:
                slot = self._free_slots.pop()
            else:  # the least recently used slot no adapter of this pass holds
                victim = next(i for i in self._slot_of if i not in wanted)
                slot = self._slot_of.pop(victim)
            self._write(slot, adapter)
            self._slot_of[lora_id] = slot
        return {lora_id: self._slot_of[lora_id] for lora_id in wanted}


class LoRAFollower:
    """The adapters of a tensor-parallel rank other than 0: its slots hold what rank 0's :class:`LoRAManager`
    put into its own, copied from the :class:`LoRAStep` sent with each step (:meth:`receive`); it reads no
    adapter itself."""

    def __init__(self, slots: LoRASlots) -> None:
        self.slots = slots
        self._step: Optional[LoRAStep] = None

    def receive(self, step: LoRAStep) -> None:
        """Apply rank 0's slot writes, and keep its slot index for the step's pass."""
        for slot, adapter in step.writes.items():
            self.slots.write(slot, adapter)
        self._step = step

    def begin_pass(self, lora_requests: typing.Sequence[Optional[LoRARequest]], token_counts: typing.Sequence[int],
                   order: typing.Sequence[int]) -> None:
        """Set the slot index of the pass from the step :meth:`receive` got (``lora_requests``: the step's
        requests, whose count it must match)."""
        step, self._step = self._step, None
        if step is None or len(step.slots) != len(lora_requests):
            got = "none" if step is None else f"one for {len(step.slots)} requests"
            raise RuntimeError(f"this rank runs a step of {len(lora_requests)} requests but got {got} from rank 0's "
                               "LoRA manager; the executor must send each step's LoRAStep (StepMessage.lora)")
        self.slots.begin_pass(step.slots, token_counts, order)

    def end_pass(self) -> None:
        self.slots.end_pass()


def _is_adaptable(prefix: str, packed: dict[str, list[str]]) -> bool:
    """A decoder layer's projection (``model.layers.N.*``); not the LM head or anything outside the layers."""
    leaf = prefix.rsplit(".", 1)[-1]
    return ".layers." in f".{prefix}" and (leaf in packed or leaf.endswith("_proj"))
