"""LoRA adapters in the simulator: which adapters a simulated replica holds, and what loading them costs.

A replica keeps ``--max-cpu-loras`` adapters in memory and ``--max-loras`` of them in the slots a step computes
with, each set least recently used first out, as the real runner does (``pagoda.execution.lora``). A step whose
requests use an adapter that is not in a slot pays ``slot_seconds`` for it (its weights copied into the slot), and
``load_seconds`` more when it is not in memory either (read and checked from disk). The real scheduler plugin
bounds the adapters of a step by ``--max-loras`` (it holds a request back until a slot frees). A step with adapter
tokens costs ``step_overhead`` more, as a fraction of the cost model's step time (the LoRA terms of the linear
layers; the cost model is calibrated on the base model).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from pagoda.config import LoRAConfig

# what `pagoda bench latency --lora-adapters 1` printed for a rank-16 adapter of the default model (every projection)
# on a 2-core AVX2 EPYC shared with other heavy jobs (docs/lora.md): reading and checking it from disk, copying it
# into a slot. A quiet machine is faster: measure yours and pass --lora-load-ms / --lora-slot-ms.
DEFAULT_LOAD_MS = 140.0
DEFAULT_SLOT_MS = 17.0


@dataclass(frozen=True)
class LoRACosts:
    """Seconds of loading an adapter from disk and into a slot; a step's extra fraction with adapter tokens."""

    load_seconds: float = DEFAULT_LOAD_MS / 1e3
    slot_seconds: float = DEFAULT_SLOT_MS / 1e3
    step_overhead: float = 0.0


class AdapterResidency:
    """One simulated replica's adapters in memory and in slots (names, least recently used first)."""

    def __init__(self, config: LoRAConfig, costs: LoRACosts) -> None:
        self.max_loras, self.max_cpu_loras = config.max_loras, config.max_cpu_loras
        self.costs = costs
        self.in_memory: OrderedDict[str, None] = OrderedDict()
        self.in_slots: OrderedDict[str, None] = OrderedDict()
        self.num_loads = 0  # from disk
        self.num_slot_loads = 0

    def step_seconds(self, names: Iterable[str]) -> float:
        """The loading seconds a step using adapters ``names`` pays (and the adapters it leaves where)."""
        seconds = 0.0
        for name in names:
            if name in self.in_slots:
                self.in_slots.move_to_end(name)
                self.in_memory.move_to_end(name)
                continue
            if name not in self.in_memory:
                seconds += self.costs.load_seconds
                self.num_loads += 1
            seconds += self.costs.slot_seconds
            self.num_slot_loads += 1
            _touch(self.in_memory, name, self.max_cpu_loras)
            _touch(self.in_slots, name, self.max_loras)
        return seconds


def _touch(lru: OrderedDict[str, None], name: str, capacity: int) -> None:
    lru[name] = None
    lru.move_to_end(name)
    while len(lru) > capacity:
        lru.popitem(last=False)
