"""The ``ngram`` proposer (prompt lookup): continue the latest earlier match of the sequence's own tail.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n
tokens of the prompt-plus-output are searched for earlier in the same
sequence; the tokens that followed the most recent match (with k tokens after it) are proposed. No
model runs, so the drafts carry no distribution: the rejection sampler treats
each as a point mass. Strong where the output copies its input (summaries,
code edits, extraction), useless on free text.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.errors import ConfigError
from pagoda.step import SchedulerOutput


def ngram_lookup(token_ids: Sequence[int], max_n: int, min_n: int, num_drafts: int) -> list[int]:
    """The up to ``num_drafts`` tokens that followed the latest earlier occurrence of the longest
    matching tail (``max_n`` down to ``min_n`` tokens); ``[]`` when nothing matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: every occurrence except the tail itself
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            # the latest match with a full continuation, else the one with the longest continuation
            full = hits[hits + n + num_drafts <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start:start + num_drafts].tolist()
    return []


class NgramProposer:
    """Proposes from the request's own tokens; needs no KV cache and no model."""

    def __init__(self, speculative_config: SpeculativeConfig, engine_config: EngineConfig, runner: Any = None,
                 plugin_manager: Any = None) -> None:
        self.max_n = speculative_config.prompt_lookup_max
        self.min_n = speculative_config.prompt_lookup_min
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(
                f"speculative_config prompt_lookup_min={self.min_n}, prompt_lookup_max={self.max_n}; need "
                "1 <= prompt_lookup_min <= prompt_lookup_max (e.g. 1 and 4)"
            )

    def propose(self, sched: SchedulerOutput) -> tuple[list[list[int]], list[Optional[Any]]]:
        """Up to ``sched.num_draft_slots[i]`` drafts per request (none where it has no slots); no probabilities."""
        drafts = [ngram_lookup(req.all_token_ids, self.max_n, self.min_n, k) if k else []
                  for req, k in zip(sched.requests, sched.num_draft_slots)]
        return drafts, [None] * len(drafts)
