"""The benchmark workloads of docs/benchmarks.md as traces, drawn with the model's tokenizer exactly as
``pagoda bench`` draws them."""

from __future__ import annotations

import math
import random
from typing import Optional

from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.simulate.trace import TraceRequest, poisson_arrivals

WORKLOADS = ("W1", "W2", "W4")


def workload_trace(name: str, model: Optional[str], rate: float = math.inf, num_requests: int = 64,
                   seed: int = 0) -> list[TraceRequest]:
    """W1 (random-64, all at once unless ``rate`` is given), W2 (shared prefix) or W4 (the W1 requests with
    Poisson arrivals at ``rate`` req/s, seeded like ``pagoda bench serve``)."""
    from pagoda.engine.components import load_tokenizer
    from pagoda.engine.engine_args import load_hf_config
    from pagoda.modeling.default_model import resolve_model_path
    from pagoda.plugins.entrypoints.bench.workloads import random_64, shared_prefix

    name = name.upper()
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name == "W4" and math.isinf(rate):
        raise ConfigError("W4 is W1 at a finite Poisson rate; pass --rate (e.g. --rate 4)")
    model_dir = resolve_model_path(model)
    config = load_hf_config(model_dir)
    vocab = int(config.get("text_config", config)["vocab_size"])
    special = set(load_tokenizer(str(model_dir), None).all_special_ids)
    if name == "W2":
        drawn = shared_prefix(vocab, special, num_requests)
    else:
        drawn = random_64(vocab, special, num_requests)
    # `pagoda bench serve` sends request i after i exponential gaps drawn from Random(seed)
    arrivals = poisson_arrivals(len(drawn), rate, random.Random(seed))
    return [TraceRequest(t, r.output_len, len(r.prompt_token_ids), prompt_token_ids=list(r.prompt_token_ids))
            for t, r in zip(arrivals, drawn)]
