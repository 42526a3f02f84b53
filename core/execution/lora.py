"""Multi-LoRA serving on the runner's side: adapters in memory, their slots in the stacked weights, and the
per-pass slot index every adapted layer reads.

Each adaptable linear layer of the model gets a :class:`LoRALayer` (its ``lora`` attribute) holding stacked
weights for ``max_loras`` slots: ``lora_a [max_loras, S * R, in]`` and ``lora_b [max_loras, out, S * R]``,
where ``S`` is the layer's output slices (3 for fused QKV) and ``R`` the engine's ``max_lora_rank``. Slice ``i``
of an adapter occupies rank rows ``[i * R, i * R + r)`` of A and the matching columns of B in its own output
rows only, so one shrink and one expand compute every slice. A slot is empty (zeros) where its adapter does
not adapt a layer.

Per forward pass, :meth:`LoRAManager.begin_pass` gives each request's adapter a slot (loading it into the
slot if it is not there) and sets the :class:`pagoda.step.LoRABatch` all layers read; the backend then adds
every adapter's terms in one call per layer.
"""

from __future__ import annotations

import logging
import typing
from collections import OrderedDict
from typing import Any, Optional

import torch

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.execution.lora_adapter import LoRAAdapter, LoRATarget, load_adapter
from pagoda.lora_request import LoRARequest
from pagoda.step import LoRABatch

logger = logging.getLogger("pagoda")


class LoRAPass:
    """What every adapted layer reads during one forward pass: the pass's :class:`LoRABatch`, or None when
    no token of the pass uses an adapter (the layers then add nothing)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


class LoRALayer:
    """One linear layer's adapter slots; ``add(x, y)`` adds the pass's LoRA terms to ``y`` in place."""

    def __init__(self, target: LoRATarget, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 current: LoRAPass, backend: Any) -> None:
        self.output_sizes = target.output_sizes
        self.rank = config.max_lora_rank
        num_slices, out = len(target.output_sizes), sum(target.output_sizes)
        self.lora_a = torch.zeros(config.max_loras, num_slices * self.rank, target.in_features, dtype=dtype,
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
        """Write one adapter's slices into ``slot`` (zeros where it has none); a: ``[r, in]``, b: ``[out_i, r]``."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        start = 0
        for i, size in enumerate(self.output_sizes):
            if a[i] is not None:  # rank r <= R: load_adapter refuses larger ones
                cols = slice(i * self.rank, i * self.rank + a[i].shape[0])
                self.lora_a[slot, cols].copy_(a[i])
                self.lora_b[slot, start:start + size, cols].copy_(b[i])
            start += size

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


class LoRAManager:
    """The runner's adapters: up to ``max_cpu_loras`` loaded in memory (least recently used evicted) and up to
    ``max_loras`` of them in slots, the ones the current pass's requests use. Keeps no request state."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, model: torch.nn.Module, backend: Any,
                 device: torch.device) -> None:
        self.config = config
        self.dtype = model_config.dtype
        self.backend = backend
        self.current = LoRAPass()
        # the model's fused layers and the checkpoint projections each stacks (vLLM's packed_modules_mapping)
        self.packed: dict[str, list[str]] = dict(model.packed_modules_mapping)
        self.layers: dict[str, LoRALayer] = {}
        self.targets: dict[str, LoRATarget] = {}
        for module in model.modules():
            prefix = getattr(module, "prefix", None)
            if not hasattr(module, "lora") or not prefix or not _is_adaptable(prefix, self.packed):
                continue
            if getattr(module, "tp_rows", None) is not None or getattr(module, "tp_cols", None) is not None:
                raise ConfigError("LoRA does not run with tensor parallelism yet; drop --enable-lora or use "
                                  "tensor_parallel_size=1")
            target = LoRATarget(module.in_features, tuple(module.output_sizes))
            self.targets[prefix] = target
            module.lora = self.layers[prefix] = LoRALayer(target, config, self.dtype, device, self.current, backend)
        if not self.layers:
            raise ConfigError(f"{model_config.architecture} has no linear layer LoRA can adapt; drop --enable-lora")
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, oldest use first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, oldest use first
        self._free_slots = list(range(config.max_loras))

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
        for layer in self.layers.values():
            layer.clear_slot(slot)
        self._free_slots.append(slot)
        return True

    def loaded_ids(self) -> list[int]:
        return list(self._loaded)

    # ---- a forward pass --------------------------------------------------------------------

    def begin_pass(self, lora_requests: typing.Sequence[Optional[LoRARequest]], token_counts: typing.Sequence[int],
                   order: typing.Sequence[int]) -> None:
        """Set the slot index of a pass whose request ``i`` (``lora_requests[i]``, None for the base model)
        computes ``token_counts[i]`` tokens, laid out in ``order`` (the batch's rows: request ``order[0]``'s
        tokens first). Loads adapters into slots as needed."""
        if all(r is None for r in lora_requests):
            self.current.batch = None
            return
        slots = self._assign_slots([r for r in lora_requests if r is not None])
        per_request = [-1 if r is None else slots[r.lora_int_id] for r in lora_requests]
        token_slots = torch.repeat_interleave(torch.tensor([per_request[i] for i in order], dtype=torch.int64),
                                              torch.tensor([token_counts[i] for i in order], dtype=torch.int64))
        self.current.batch = LoRABatch.from_token_slots(token_slots)

    def end_pass(self) -> None:
        self.current.batch = None

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
            for prefix, layer in self.layers.items():
                if prefix in adapter.lora_a:
                    layer.set_slot(slot, adapter.lora_a[prefix], adapter.lora_b[prefix])
                else:
                    layer.clear_slot(slot)
            self._slot_of[lora_id] = slot
        return {lora_id: self._slot_of[lora_id] for lora_id in wanted}


def _is_adaptable(prefix: str, packed: dict[str, list[str]]) -> bool:
    """A decoder layer's projection (``model.layers.N.*``); not the LM head or anything outside the layers."""
    leaf = prefix.rsplit(".", 1)[-1]
    return ".layers." in f".{prefix}" and (leaf in packed or leaf.endswith("_proj"))
