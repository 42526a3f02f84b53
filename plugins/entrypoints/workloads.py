"""The fixed benchmark workloads of BENCHMARK.md, drawn exactly as specified there."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_64(vocab_size: int, special_ids: set[int], num_requests: int = 64, seed: int = 0) -> list[BenchRequest]:
    """W1: log-normal prompt and output lengths, random non-special token ids."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        l_in = min(512, max(32, int(rng.lognormvariate(4.9, 0.6))))
        l_out = min(256, max(16, int(rng.lognormvariate(4.3, 0.6))))
        ids = []
        for _ in range(l_in):
            token = rng.randrange(100, vocab_size)
            while token in special_ids:
                token = rng.randrange(100, vocab_size)
            ids.append(token)
        requests.append(BenchRequest(ids, l_out))
    return requests


def latency_1(vocab_size: int, special_ids: set[int], prompt_len: int = 128, output_len: int = 128,
              seed: int = 0) -> BenchRequest:
    """W3: one request, 128 prompt tokens, 128 output tokens."""
    rng = random.Random(seed)
    ids = []
    while len(ids) < prompt_len:
        token = rng.randrange(100, vocab_size)
        if token not in special_ids:
            ids.append(token)
    return BenchRequest(ids, output_len)


def shared_prefix(vocab_size: int, special_ids: set[int], num_requests: int = 64, prefix_len: int = 1024,
                  suffix_len: int = 32, output_len: int = 32, seed: int = 0) -> list[BenchRequest]:
    """W2: one shared prefix, a distinct suffix per request."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        ids = []
        while len(ids) < n:
            token = rng.randrange(100, vocab_size)
            if token not in special_ids:
                ids.append(token)
        return ids

    prefix = draw(prefix_len)
    return [BenchRequest(prefix + draw(suffix_len), output_len) for _ in range(num_requests)]
