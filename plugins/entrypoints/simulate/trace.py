"""Request traces for ``pagoda simulate``: JSON lines, one request a line, in arrival order.

A line holds ``arrival`` (seconds from the trace's start), ``output_len`` (tokens to generate),
optionally ``priority`` (lower runs first under the ``priority`` policy, default 0) and ``tenant`` (who
sent it: the ``fair`` policy shares the engine between tenants; the report gives each tenant's TTFT and
TPOT when the trace has more than one), ``lora_name`` (the LoRA adapter it names; absent: the base model), and the
prompt either as ``prompt_token_ids`` or as ``prompt_len`` plus, for prompts that share a prefix,
``prefix_group`` (any integer) and ``prefix_len`` (how many leading tokens the group shares).
Synthetic prompts get token ids drawn once per group and a per-request suffix that nothing else
shares, so the prefix cache sees exactly the sharing the trace describes.

Sources: the benchmark workloads (W1, W2, W4-like Poisson W1), a generator of Poisson or bursty
arrivals with prefix groups, and ``pagoda serve --request-log`` files.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from pagoda.errors import ConfigError

# the longest tenant name a trace line may give
MAX_TENANT_CHARS = 256
# synthetic token ids are drawn from [FIRST_TOKEN_ID, vocab_size): the low ids of most tokenizers are special
FIRST_TOKEN_ID = 100


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival: float
    output_len: int
    prompt_len: int
    priority: int = 0
    prompt_token_ids: Optional[list[int]] = None
    prefix_group: Optional[int] = None
    prefix_len: int = 0
    tenant: Optional[str] = None
    lora_name: Optional[str] = None  # the LoRA adapter it names (None: the base model)

    def to_json(self) -> dict:
        line = {"arrival": self.arrival, "output_len": self.output_len}
        if self.priority:
            line["priority"] = self.priority
        if self.tenant is not None:
            line["tenant"] = self.tenant
        if self.lora_name is not None:
            line["lora_name"] = self.lora_name
        if self.prompt_token_ids is not None:
            line["prompt_token_ids"] = self.prompt_token_ids
        else:
            line["prompt_len"] = self.prompt_len
            if self.prefix_group is not None:
                line.update(prefix_group=self.prefix_group, prefix_len=self.prefix_len)
        return line


class PromptMaker:
    """Materialises a request's prompt token ids when it arrives (a 100k-request trace never holds them all)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= FIRST_TOKEN_ID + 2:
            raise ConfigError(f"a vocabulary of {vocab_size} tokens is too small for synthetic prompts "
                              f"(ids from {FIRST_TOKEN_ID} up)")
        self.span = vocab_size - FIRST_TOKEN_ID
        self.seed = seed
        self._prefixes: dict[int, list[int]] = {}

    def tokens(self, index: int, req: TraceRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        shared = 0
        ids: list[int] = []
        if req.prefix_group is not None and req.prefix_len:
            shared = min(req.prefix_len, req.prompt_len)
            ids = self._prefix(req.prefix_group, shared)
        # the suffix starts with the request's index in two digits of base `span`: unique per request
        span, base = self.span, FIRST_TOKEN_ID
        suffix = [base + index % span, base + (index // span) % span]
        suffix += [base + (index * 7919 + j * 104729) % span for j in range(req.prompt_len - shared - 2)]
        return ids + suffix[:req.prompt_len - shared]

    def _prefix(self, group: int, length: int) -> list[int]:
        prefix = self._prefixes.get(group)
        if prefix is None or len(prefix) < length:
            rng = random.Random(f"{self.seed}-{group}")
            prefix = [FIRST_TOKEN_ID + rng.randrange(self.span) for _ in range(max(length, 64))]
            self._prefixes[group] = prefix
        return prefix[:length]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON-lines trace; raise ConfigError naming the line and field that is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace file {path} does not exist; write one with `pagoda simulate --generate ...` or "
                          "convert a server log with `--from-request-log`")
    requests = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                requests.append(_parse_line(line, f"{path}:{lineno}"))
    if not requests:
        raise ConfigError(f"trace file {path} holds no request")
    requests.sort(key=lambda r: r.arrival)  # stable: equal arrivals keep file order
    return requests


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not a JSON object ({exc})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: each line must be a JSON object such as "
                          '{"arrival": 0.5, "prompt_len": 128, "output_len": 64}')

    def number(name: str, kind: type, default=None, minimum: float = 0):
        value = d.get(name, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (kind is int and value != int(value)) or not math.isfinite(value) or value < minimum:
            raise ConfigError(f"{where}: {name}={d.get(name)!r}; expected {'an integer' if kind is int else 'a number'}"
                              f" >= {minimum}")
        return kind(value)

    arrival = number("arrival", float)
    output_len = number("output_len", int, minimum=1)
    priority = number("priority", int, default=0, minimum=-(2 ** 31))
    tenant = d.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS):
        raise ConfigError(f"{where}: tenant={tenant!r}; expected a name (a string of 1 to {MAX_TENANT_CHARS} "
                          "characters), or no tenant field for the shared tenant")
    lora_name = d.get("lora_name")
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ConfigError(f"{where}: lora_name={lora_name!r}; expected the LoRA adapter's name (a non-empty "
                          "string), or no lora_name field for the base model")
    ids = d.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ConfigError(f"{where}: prompt_token_ids must be a non-empty list of token ids (integers >= 0)")
        return TraceRequest(arrival, output_len, len(ids), priority, prompt_token_ids=ids, tenant=tenant,
                            lora_name=lora_name)
    if "prompt_len" not in d:
        raise ConfigError(f"{where}: give the prompt as prompt_token_ids or as prompt_len (with prefix_group and "
                          "prefix_len for a shared prefix)")
    prompt_len = number("prompt_len", int, minimum=1)
    group = d.get("prefix_group")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise ConfigError(f"{where}: prefix_group={group!r}; expected an integer naming the group")
    prefix_len = number("prefix_len", int, default=0) if group is not None else 0
    if prefix_len > prompt_len:
        raise ConfigError(f"{where}: prefix_len {prefix_len} exceeds prompt_len {prompt_len}")
    return TraceRequest(arrival, output_len, prompt_len, priority, prefix_group=group, prefix_len=prefix_len,
                        tenant=tenant, lora_name=lora_name)


def save_trace(requests: Iterable[TraceRequest], path: str | Path) -> int:
    n = 0
    with Path(path).open("w") as f:
        for req in requests:
            f.write(json.dumps(req.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def poisson_arrivals(num_requests: int, rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """Arrival times: gaps drawn from a gamma distribution of mean ``1/rate``; ``burstiness`` 1 is Poisson,
    above 1 burstier (gap coefficient of variation ``sqrt(burstiness)``); ``rate`` inf: all at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ConfigError(f"rate ({rate}) and burstiness ({burstiness}) must be positive")
    if math.isinf(rate):
        return [0.0] * num_requests
    shape = 1.0 / burstiness
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        # burstiness 1 draws exactly the exponential gaps `pagoda bench serve` draws from the same seed
        t += rng.expovariate(rate) if burstiness == 1 else rng.gammavariate(shape, 1.0 / (rate * shape))
    return times


def generate_trace(num_requests: int, rate: float = 4.0, burstiness: float = 1.0, num_groups: int = 0,
                   prefix_len: int = 512, group_fraction: float = 1.0, priority_levels: int = 1,
                   seed: int = 0, prompt_len: Optional[int] = None, output_len: Optional[int] = None
                   ) -> list[TraceRequest]:
    """A synthetic trace: W1's log-normal prompt and output lengths (or the fixed ``prompt_len`` /
    ``output_len``), gamma (Poisson) arrivals, and with ``num_groups`` > 0, a ``group_fraction`` of
    requests whose prompt is one of ``num_groups`` shared prefixes of ``prefix_len`` tokens followed by
    the request's own tokens; priorities uniform over ``priority_levels``."""
    if num_requests < 1:
        raise ConfigError(f"--num-requests {num_requests}: generate at least one request")
    if (prompt_len is not None and prompt_len < 1) or (output_len is not None and output_len < 1):
        raise ConfigError(f"--prompt-len ({prompt_len}) and --output-len ({output_len}) must be at least 1")
    if not 0 <= group_fraction <= 1 or priority_levels < 1 or num_groups < 0 or prefix_len < 0:
        raise ConfigError("group fraction must be in [0, 1], priority levels >= 1, groups and prefix length >= 0")
    rng = random.Random(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng, burstiness)
    requests = []
    for arrival in arrivals:
        own = min(512, max(32, int(rng.lognormvariate(4.9, 0.6))))
        out = min(256, max(16, int(rng.lognormvariate(4.3, 0.6))))
        own, out = prompt_len or own, output_len or out
        priority = rng.randrange(priority_levels)
        if num_groups and prefix_len and rng.random() < group_fraction:
            group = rng.randrange(num_groups)
            requests.append(TraceRequest(arrival, out, prefix_len + own, priority, prefix_group=group,
                                         prefix_len=prefix_len))
        else:
            requests.append(TraceRequest(arrival, out, own, priority))
    return requests


def flood_trace(num_small: int = 20, small_rate: float = 1.0, small_prompt_len: int = 5, small_output_len: int = 16,
                flood_requests: int = 13, flood_n: int = 8, flood_output_len: int = 1000) -> list[TraceRequest]:
    """One tenant floods, another sends small requests: ``flood_requests`` x ``flood_n`` one-token prompts asking
    for ``flood_output_len`` tokens each at time 0 (tenant ``flood``; the probe of the server sent thirteen of
    n=8, max_tokens 8000), then ``num_small`` requests of ``small_prompt_len`` + ``small_output_len`` tokens,
    ``1 / small_rate`` seconds apart from one second on (tenant ``small``)."""
    if min(num_small, flood_requests, flood_n, flood_output_len, small_prompt_len, small_output_len) < 1 or \
            not small_rate > 0:
        raise ConfigError("the flood workload needs at least one request and one token of each kind and a "
                          f"positive rate (got {num_small} small requests at {small_rate} req/s)")
    flood = [TraceRequest(0.0, flood_output_len, 1, tenant="flood") for _ in range(flood_requests * flood_n)]
    small = [TraceRequest(1.0 + i / small_rate, small_output_len, small_prompt_len, tenant="small")
             for i in range(num_small)]
    return flood + small
