"""What vLLM's serving benchmark client (``vllm bench serve``) sends and measures, so that ``pagoda bench serve``
gives the same figures without vLLM installed.

The facts, as vLLM 0.32's client has them:

- **Prompts** (``--dataset-name random``): with ``numpy.random.default_rng(seed)``, the input lengths, then the
  output lengths (integers, uniform in ``[floor(L(1 - r)), ceil(L(1 + r))]`` for range ratio ``r``; the input
  length less the special tokens the tokenizer adds), then one vocabulary offset per request. The allowed
  tokens are the tokenizer's base vocabulary less its special tokens, in the order of Python's set; request
  ``i``'s tokens are allowed tokens ``(offset + i + j) mod len(allowed)`` for ``j < input length``. Each is
  decoded to text, re-encoded, and cut or padded (with ids from the same generator) until it re-encodes to its
  length (at most 10 rounds). The text goes to the server, which tokenizes it.
- **Arrivals**: ``numpy.random.seed(seed)``; per request a gap drawn from a gamma distribution of shape
  ``burstiness`` and scale ``1 / (rate x burstiness)`` (exponential, a Poisson process, at burstiness 1);
  the gaps summed, and the times scaled so that the last request leaves at ``num_requests / rate`` s. The first
  request waits its own gap. Nothing goes before the run: the client's lone test request runs only with
  ``--ready-check-timeout-sec`` above 0 (its default is 0, which prints "Starting initial single prompt test
  run..." and then skips it).
- **Request**: ``/v1/completions`` with the text prompt, ``max_tokens``, ``repetition_penalty: 1.0``,
  ``logprobs: null``, ``stream`` with usage, ``ignore_eos`` when asked, and no temperature unless given: the
  server's default sampling (temperature 1 unless the model's generation config says otherwise).
- **Timing**: every streamed message that has ``choices`` is a token event (empty text too), stamped with the
  time the network read that completed it arrived. TTFT is the first event; ITL the gaps between events; the
  request's latency ends at its last event; TPOT is ``(latency - TTFT) / (output tokens - 1)`` with the output
  tokens from the usage message. Output tok/s is all output tokens over the run's wall time, from just before
  the first arrival to the last response.
"""

from __future__ import annotations

import codecs
import json
import math
from typing import Optional

import numpy as np

from pagoda.plugins.entrypoints.bench.workloads import BenchRequest

MAX_REENCODE_ROUNDS = 10


def _length_bounds(length: int, ratio: float) -> tuple[int, int]:
    return math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))


def vllm_random_requests(tokenizer, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                         seed: int = 0) -> list[BenchRequest]:
    """The requests of vLLM's ``random`` dataset for ``tokenizer`` (a Hugging Face tokenizer): text prompts that
    re-encode to their drawn lengths (token ids kept beside them), each asking for its drawn output length."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio {range_ratio}: give a ratio in [0, 1)")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - int(tokenizer.num_special_tokens_to_add()))
    in_low, in_high = _length_bounds(real_input_len, range_ratio)
    out_low, out_high = _length_bounds(output_len, range_ratio)
    out_low, out_high = max(out_low, 1), max(out_high, 1)
    if in_low < 1:
        raise ValueError(f"--input-len {input_len} with range ratio {range_ratio} allows prompts of {in_low} tokens; "
                         "give a longer input length or a smaller ratio")
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    vocab_size = tokenizer.vocab_size
    offsets = rng.integers(0, vocab_size, size=num_requests)
    # the order of a Python set of the ids is part of the dataset: keep it
    allowed = np.array(list(set(np.arange(vocab_size)) - set(tokenizer.all_special_ids)))
    requests = []
    for i in range(num_requests):
        ids = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        text, ids = _reencoded(tokenizer, ids, int(input_lens[i]), rng)
        requests.append(BenchRequest(ids, int(output_lens[i]), prompt_text=text))
    return requests


def _reencoded(tokenizer, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, list[int]]:
    """The text of ``ids`` adjusted until it encodes to ``target`` tokens (or the rounds run out): cut when longer,
    padded with random ids when shorter."""
    for round_ in range(MAX_REENCODE_ROUNDS + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if round_ == MAX_REENCODE_ROUNDS or len(ids) == target:
            break
        if len(ids) < target:
            ids.extend(rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist())
        else:
            ids = ids[:target]
    return text, ids


def vllm_arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request leaves, as vLLM's client sends them."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness {burstiness}: give a factor > 0 (1: Poisson arrivals)")
    if math.isinf(rate):
        return [0.0] * num_requests
    state = np.random.RandomState(seed)  # the stream numpy.random.seed(seed) gives the global functions
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * num_requests
    else:
        gaps = [float(state.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))) for _ in range(num_requests)]
    times = np.cumsum(gaps).tolist()
    if times and times[-1] != 0:
        scale = num_requests / rate / times[-1]
        times = [t * scale for t in times]
    return times


def completion_body(model: str, req: BenchRequest, ignore_eos: bool = True,
                    sampling: Optional[dict] = None) -> dict:
    """The ``/v1/completions`` body vLLM's client sends for ``req``."""
    body = {"model": model, "prompt": req.prompt_text if req.prompt_text is not None else req.prompt_token_ids,
            "repetition_penalty": 1.0, "max_tokens": req.output_len, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(sampling or {})
    return body


class SSEReader:
    """Splits a streamed response's bytes into its ``data:`` messages, as they complete."""

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._decoder.decode(chunk)
        messages = []
        while "\n\n" in self._buffer:
            message, self._buffer = self._buffer.split("\n\n", 1)
            message = message.strip()
            if message:
                messages.append(message)
        rest = self._buffer.strip()
        if rest.startswith("data: ") and _complete(rest[6:].strip()):
            messages.append(rest)
            self._buffer = ""
        return messages


def _complete(payload: str) -> bool:
    if payload == "[DONE]":
        return True
    try:
        json.loads(payload)
    except ValueError:
        return False
    return bool(payload)
