"""Engine statistics: plain counters and samples, read by the server's Prometheus exporter."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagoda.request import Request


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_arrived: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    num_steps: int = 0

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.num_requests_arrived += 1
        self.num_prompt_tokens += num_prompt_tokens

    def on_step(self, sched, progressed: list[Request], now: float) -> None:
        self.num_steps += 1
        self.num_generation_tokens += len(progressed)

    def on_finished(self, request: Request) -> None:
        self.finished_by_reason[request.finish_reason] += 1
