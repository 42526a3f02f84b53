"""``pagoda bench serve --workload vllm-random`` sends what vLLM's serving client sends: the same text prompts
and arrival times as vLLM 0.32's client with the same seed (fingerprints taken from vLLM's own code), and reads
the stream as it does."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from pagoda.plugins.entrypoints.bench.vllm_client import (SSEReader, completion_body, vllm_arrival_times,
                                                          vllm_random_requests)
from pagoda.plugins.entrypoints.bench.workloads import BenchRequest


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagoda.modeling.default_model import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(None)))


def fingerprint(requests: list[BenchRequest]) -> str:
    return hashlib.sha256("\x00".join(r.prompt_text for r in requests).encode()).hexdigest()


def test_prompts_are_vllms_random_dataset_for_the_default_model(tokenizer):
    # vLLM 0.32's RandomDataset(random_seed=0).sample(tokenizer, 48, input_len=128, output_len=64)
    requests = vllm_random_requests(tokenizer, 48, 128, 64, seed=0)
    assert requests[0].prompt_text.startswith(" Infrared Treating cartsLeanslotsawning pooled feministsbrot")
    assert fingerprint(requests) == "28b064b64e9036ae47503dcf7ea975f61ac328c89674c2b17025b29d902c40e9"
    for r in requests:  # text that the server re-encodes to exactly the drawn length
        assert r.output_len == 64 and len(r.prompt_token_ids) == 128
        assert tokenizer.encode(r.prompt_text, add_special_tokens=False) == r.prompt_token_ids


def test_a_range_ratio_draws_lengths_as_vllm_does(tokenizer):
    # vLLM 0.32's RandomDataset(random_seed=5).sample(..., 20, input_len=128, output_len=64, range_ratio=0.5)
    requests = vllm_random_requests(tokenizer, 20, 128, 64, range_ratio=0.5, seed=5)
    assert fingerprint(requests) == "8a408fb4ff0823a1c2dce200f7d811c61090212afc3a6852765fe11656519ac7"
    assert [len(r.prompt_token_ids) for r in requests[:5]] == [150, 167, 66, 168, 124]
    assert [r.output_len for r in requests[:5]] == [44, 74, 80, 47, 50]
    with pytest.raises(ValueError, match="range ratio|ratio in"):
        vllm_random_requests(tokenizer, 2, 128, 64, range_ratio=1.0)


def test_arrival_times_are_vllms():
    # vLLM 0.32's get_request after numpy.random.seed(seed), as its client runs it
    times = vllm_arrival_times(48, 8.0, 1.0, seed=0)
    assert times[:3] == pytest.approx([0.09308508848576602, 0.23997812878742988, 0.3479578508891289], abs=1e-12)
    assert times[-1] == pytest.approx(48 / 8.0)
    bursty = vllm_arrival_times(20, 4.0, 0.5, seed=5)
    assert bursty[:3] == pytest.approx([0.039025340835240015, 0.07286522894189988, 0.26176815439219486], abs=1e-12)
    assert vllm_arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert vllm_arrival_times(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="burstiness"):
        vllm_arrival_times(4, 2.0, 0.0)


def test_the_body_has_no_temperature_unless_given():
    req = BenchRequest([5, 6], 7, prompt_text="hi there")
    body = completion_body("m", req)
    assert body["prompt"] == "hi there" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert "temperature" not in body and body["repetition_penalty"] == 1.0 and body["stream"] is True
    assert completion_body("m", req, sampling={"temperature": 0.0})["temperature"] == 0.0


def test_sse_messages_are_split_across_reads_and_completed_without_a_blank_line():
    reader = SSEReader()
    first = json.dumps({"choices": [{"text": "é"}]}).encode()
    assert reader.feed(b"data: " + first[:9]) == []
    assert reader.feed(first[9:] + b"\n\ndata: {\"choi") == ["data: " + first.decode()]
    assert reader.feed(b"ces\": []}") == ['data: {"choices": []}']  # complete JSON, no separator yet
    assert reader.feed(b"\n\ndata: [DONE]") == ["data: [DONE]"]
    # a multi-byte character cut between two reads
    reader = SSEReader()
    text = 'data: {"t": "\u00e9"}\n\n'.encode()
    cut = text.index(b"\xc3") + 1
    assert reader.feed(text[:cut]) == [] and reader.feed(text[cut:]) == ['data: {"t": "\u00e9"}']


def test_a_run_sends_each_request_once_and_nothing_before_it():
    """vLLM 0.32's client sends no lone test request by default (its ready check is off), so neither does the
    run: a lone first request would warm the server and, with prefix caching, cache the first prompt."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pagoda.plugins.entrypoints.bench.serve import run_rate

    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for message in ({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}):
                self.wfile.write(b"data: " + json.dumps(message).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        requests = [BenchRequest([5, 6], 2, prompt_text=f"prompt {i}") for i in range(3)]
        bodies = [completion_body("m", r) for r in requests]
        url = f"http://127.0.0.1:{server.server_address[1]}"
        _, timings = asyncio.run(run_rate(url, None, requests, bodies, [0.0, 0.01, 0.02], False, "test"))
    finally:
        server.shutdown()
        server.server_close()
    assert received == ["prompt 0", "prompt 1", "prompt 2"]
    assert all(t.ok and t.output_tokens == 2 for t in timings)
