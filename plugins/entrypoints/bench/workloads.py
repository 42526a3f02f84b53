"""The fixed benchmark workloads of docs/benchmarks.md, drawn exactly as specified there."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    # the prompt-prefix group of a shared-prefix workload (None: the prompt shares nothing on purpose)
    prefix_group: Optional[int] = None
    # the prompt as text, sent instead of the ids when set (vLLM's random dataset; the ids are its encoding)
    prompt_text: Optional[str] = None


def random_64(vocab_size: int, special_ids: set[int], num_requests: int = 64, seed: int = 0) -> list[BenchRequest]:
    """W1: log-normal prompt and output lengths, random non-special token ids."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        l_in = min(512, max(32, int(rng.lognormvariate(4.9, 0.6))))
        l_out = min(256, max(16, int(rng.lognormvariate(4.3, 0.6))))
        requests.append(BenchRequest(draw_token_ids(rng, l_in, vocab_size, special_ids), l_out))
    return requests


def fixed_lengths(vocab_size: int, special_ids: set[int], num_requests: int, input_len: int = 128,
                  output_len: int = 64, seed: int = 0) -> list[BenchRequest]:
    """``num_requests`` prompts of ``input_len`` random non-special token ids, each asking for ``output_len``
    tokens (the shape of vLLM's ``random`` dataset with no length range)."""
    rng = random.Random(seed)
    return [BenchRequest(draw_token_ids(rng, input_len, vocab_size, special_ids), output_len)
            for _ in range(num_requests)]


def latency_1(vocab_size: int, special_ids: set[int], prompt_len: int = 128, output_len: int = 128,
              seed: int = 0) -> BenchRequest:
    """W3: one request, 128 prompt tokens, 128 output tokens."""
    return BenchRequest(draw_token_ids(random.Random(seed), prompt_len, vocab_size, special_ids), output_len)


def shared_prefix(vocab_size: int, special_ids: set[int], num_requests: int = 64, prefix_len: int = 1024,
                  suffix_len: int = 32, output_len: int = 32, seed: int = 0) -> list[BenchRequest]:
    """W2: one shared prefix, a distinct suffix per request."""
    rng = random.Random(seed)
    prefix = draw_token_ids(rng, prefix_len, vocab_size, special_ids)
    return [BenchRequest(prefix + draw_token_ids(rng, suffix_len, vocab_size, special_ids), output_len, 0)
            for _ in range(num_requests)]


def prefix_groups(vocab_size: int, special_ids: set[int], num_requests: int = 64, num_groups: int = 4,
                  prefix_len: int = 512, suffix_len: int = 32, output_len: int = 32,
                  seed: int = 0) -> list[BenchRequest]:
    """W2 with several prefixes, interleaved: request ``i`` extends prefix ``i % num_groups`` with a distinct
    suffix (the traffic of many users of a few system prompts, where routing decides the cache hits)."""
    rng = random.Random(seed)
    prefixes = [draw_token_ids(rng, prefix_len, vocab_size, special_ids) for _ in range(num_groups)]
    return [BenchRequest(prefixes[i % num_groups] + draw_token_ids(rng, suffix_len, vocab_size, special_ids),
                         output_len, i % num_groups) for i in range(num_requests)]


def draw_token_ids(rng: random.Random, n: int, vocab_size: int, special_ids: set[int]) -> list[int]:
    """``n`` token ids from ``[100, vocab_size)``, each redrawn while it is a special token."""
    ids: list[int] = []
    while len(ids) < n:
        token = rng.randrange(100, vocab_size)
        if token not in special_ids:
            ids.append(token)
    return ids
