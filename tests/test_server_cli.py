"""``pagoda serve`` as users run it (a subprocess on the default model), ``pagoda bench serve`` against it,
and a graceful shutdown on SIGTERM (open requests past --shutdown-timeout end with an error). The
SIGTERM test ends the server; keep it last.

``pagoda bench serve`` and ``pagoda bench steps`` run as subprocesses once each, as users type them; their other
runs, whose checks are of what the commands print and write, call the same ``pagoda`` entry point in this process
(a process start costs seconds of imports each)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from pagoda.cli import main
from serve_process import ENV, PAGODA, start_server

pytestmark = pytest.mark.slow
MAX_REQUEST_CHARS = 200_000  # far above what bench serve's prompts have
# seconds: the last test's short stream (one step after its first token) ends within it even on a loaded machine
# (at a load of 15 on 2 cores a step took up to 2 s); its long requests (1,000 tokens), at the at most ~70 steps/s
# this model decodes at in bf16 on one thread (a Zen 5), do not. The test waits all of it out, so it is no longer
# than that needs
SHUTDOWN_TIMEOUT = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # bf16, the default model's own dtype (start_server's float32 is for exact tokens, which no test here compares)
    proc, url = start_server(log, "--dtype", "bfloat16", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                             "--max-request-chars", str(MAX_REQUEST_CHARS),
                             "--step-log", str(log.with_name("steps.jsonl")),
                             "--timeline-log", str(log.with_name("timeline.jsonl")))
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serve_starts_on_the_default_model_with_no_model_flag(server):
    _, url, _ = server
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
    resp = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_serve_announces_the_tool_call_parser_it_chose_and_auto_needs_no_flag(server):
    _, url, log = server
    assert "tool calls: tool_choice \"auto\" read by the 'hermes' parser and pagoda's chatml_hermes.jinja" \
        in log.read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    resp = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "max_tokens": 2})
    assert resp.status_code == 200 and "x-pagoda-warning" not in resp.headers


def test_max_request_chars_bounds_the_characters_of_a_request(server):
    _, url, _ = server
    body = {"prompt": ["a b " * 1000] * 64, "max_tokens": 1}  # 256,000 characters in 64 short prompts
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text[:500]
    assert f"the {MAX_REQUEST_CHARS} a request may have (--max-request-chars)" in resp.json()["error"]["message"]


def test_a_keyless_server_on_loopback_answers_only_loopback_host_names(server):
    _, url, _ = server
    port = url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200
    # DNS rebinding: a page on another site whose name now resolves to 127.0.0.1
    refused = httpx.get(url + "/v1/models", headers={"Host": f"attacker.example:{port}"})
    assert refused.status_code == 400 and "--allowed-hosts" in refused.json()["error"]["message"]


def run_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``pagoda ARGS`` through the console script's entry point in this process, its exit status and output as
    a subprocess's would be."""
    capsys.readouterr()
    returncode = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["pagoda", *args], returncode, out.out, out.err)


def test_bench_serve_prints_a_w4_table_and_writes_json(server, tmp_path, capsys):
    _, url, _ = server
    result_file = tmp_path / "w4.json"
    run = run_in_process(capsys, "bench", "serve", "--base-url", url, "--num-prompts", "2", "--request-rate", "inf",
                         "--no-progress", "--result-file", str(result_file), "--offline-output-tok-s", "1000",
                         "--profile")
    assert run.returncode == 0, run.stdout + run.stderr
    for label in ("request throughput", "output tokens/s", "TTFT", "TPOT", "ITL", "E2E", "p99",
                  "engine mean step (ms)", "served mean TPOT / step", "served / offline tokens/s",
                  "where a served token's time goes", "detokenization + logprobs (event loop)", "rest: HTTP writes"):
        assert label in run.stdout
    summary = json.loads(result_file.read_text())["runs"][0]["summary"]
    assert summary["completed"] == 2 and summary["failed"] == 0
    # the engine's steps during the run, from the server's /metrics, beside the served TPOT
    assert summary["engine_mean_step_ms"] > 0 and summary["tpot_over_step"] > 0
    assert summary["served_over_offline"] == summary["output_token_throughput"] / 1000.0
    # the server's event loop spent time on these streamed outputs, per step, and said so at /metrics
    per_step = summary["per_step_ms"]
    assert per_step["detokenize_seconds"] > 0 and per_step["output_seconds"] > 0 and per_step["encode_seconds"] > 0
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    # W1 requests produce exactly their drawn output lengths (ignore_eos, min_tokens = max_tokens)
    from pagoda.plugins.entrypoints.bench.serve import w1_requests

    assert summary["output_tokens"] == sum(r.output_len for r in w1_requests(None, 2))


def test_bench_serve_alternates_offline_runs_and_sets_the_served_token_beside_the_engine_s(server, tmp_path):
    _, url, _ = server
    result_file = tmp_path / "random.json"
    run = subprocess.run([PAGODA, "bench", "serve", "--base-url", url, "--workload", "random", "--input-len", "40",
                          "--output-len", "5", "--num-prompts", "2", "--request-rate", "inf", "--offline",
                          "--repeat", "2", "--no-progress", "--result-file", str(result_file)],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("offline, same requests:") == 2
    assert "served / offline output tok/s over 2 alternated runs" in run.stdout
    assert "engine time per token (ms)" in run.stdout and "the server adds" in run.stdout
    runs = json.loads(result_file.read_text())["runs"]
    assert len(runs) == 2
    for r in runs:
        s = r["summary"]
        assert s["completed"] == 2 and s["prompt_tokens"] == 80 and s["output_tokens"] == 10
        assert s["offline_output_token_throughput"] > 0
        assert s["served_over_offline"] == s["output_token_throughput"] / s["offline_output_token_throughput"]
        # the engine's own time between two tokens of a request, from /metrics, against the client's TPOT
        assert s["engine_mean_itl_ms"] > 0
        assert s["tpot_over_engine_itl"] == s["tpot_ms"]["mean"] / s["engine_mean_itl_ms"]
    # the second run drew other prompts (40 tokens: two full KV blocks that a repeat would find cached)
    assert runs[1]["summary"]["prefix_cache_hit_rate"] == 0.0
    first = [q["prompt_len"] for q in runs[0]["requests"]]
    assert first == [40, 40]


def test_bench_serve_sends_vllm_s_random_dataset_and_times_it_as_vllm_s_client(server, tmp_path, capsys):
    _, url, _ = server
    result_file = tmp_path / "vllm-random.json"
    run = run_in_process(capsys, "bench", "serve", "--base-url", url, "--dataset", "vllm-random", "--input-len", "24",
                         "--output-len", "4", "--num-prompts", "3", "--request-rate", "50", "--seed", "3",
                         "--no-progress", "--result-file", str(result_file))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "vLLM's random dataset, 24 in / 4 out, seed 3: 3 requests" in run.stdout
    out = json.loads(result_file.read_text())["runs"][0]
    s, names = out["summary"], out["vllm_names"]
    # the server tokenized the text prompts to the drawn lengths (usage), and sampled at its default temperature
    assert s["completed"] == 3 and s["prompt_tokens"] == 72 and s["output_tokens"] == 12
    assert names["output_throughput"] == s["output_token_throughput"] and names["mean_tpot_ms"] == s["tpot_ms"]["mean"]
    for r in out["requests"]:  # vLLM's definitions: TPOT over the tokens after the first, E2E at the last event
        assert r["ttft"] + sum(r["itl"]) == pytest.approx(r["e2e"])
    # no lone first request before the run (vLLM 0.32's client sends none unless --ready-check-timeout-sec is
    # set): the first prompt found nothing of itself cached
    assert out["requests"][0]["cached_tokens"] == 0


def test_the_step_log_says_what_each_step_held_and_where_its_time_went(server, tmp_path, capsys):
    _, _, log = server
    steps_file = log.with_name("steps.jsonl")
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]
    assert steps, "the earlier tests' requests ran steps"
    assert any(s["prefill_tokens"] > 0 for s in steps) and any(s["decode_rows"] > 0 for s in steps)
    for s in steps:
        assert s["step_ms"] > 0 and s["model_ms"] >= s["attention_ms"] > 0
        assert s["step_other_ms"] == pytest.approx(s["step_ms"] - s["schedule_ms"] - s["update_ms"] - s["emit_ms"]
                                                   - s["metadata_ms"] - s["model_ms"] - s["logits_ms"]
                                                   - s["sampling_ms"], abs=1e-3)
    run = subprocess.run([PAGODA, "bench", "steps", str(steps_file)], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    for label in ("decode only", "with prefill", "per decode token", "attention (K/V write + kernel)", "sampling",
                  "gap before the step", "attention share of the step"):
        assert label in run.stdout
    missing = run_in_process(capsys, "bench", "steps", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_the_timeline_log_places_each_first_token_in_order_and_in_the_step_that_made_it(server, capsys):
    _, url, log = server
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0.0}
    assert httpx.post(url + "/v1/completions", json=dict(body, stream=True), timeout=120).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
    assert httpx.post(url + "/tokenize", json={"prompt": "not a generation"}, timeout=30).status_code == 200
    timeline_file, steps_file = log.with_name("timeline.jsonl"), log.with_name("steps.jsonl")
    lines = [json.loads(line) for line in timeline_file.read_text().splitlines()]
    assert lines[-2]["stream"] and lines[-2]["request_id"].startswith("cmpl-")
    assert not lines[-1]["stream"] and lines[-1]["request_id"].startswith("chatcmpl-")
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]
    for line in lines:
        ms = line["ms"]
        assert list(ms) == ["parsed", "tokenized", "handed_in", "queued", "scheduled", "first_token", "delivered",
                            "first_output", "first_written", "done"]
        assert 0 <= ms["parsed"] and all(a <= b for a, b in zip(ms.values(), list(ms.values())[1:])), ms
        scheduled = line["received"] + ms["scheduled"] / 1e3
        first_token = line["received"] + ms["first_token"] / 1e3
        # the step log stamps a step's end just after the engine's own end (and its start as long before it)
        made_it = [s for s in steps if s["start"] - 1e-3 <= scheduled and first_token <= s["end"]]
        assert len(made_it) == 1 and made_it[0]["prefill_tokens"] > 0, (line, made_it)
    run = run_in_process(capsys, "bench", "timeline", str(timeline_file), "--step-log", str(steps_file))
    assert run.returncode == 0, run.stderr
    for label in ("waiting for the running step", "the first step (its prefill)", "server TTFT",
                  "left of the step running at hand-in", "its decode rows"):
        assert label in run.stdout
    missing = run_in_process(capsys, "bench", "timeline", str(timeline_file.with_name("none.jsonl")))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_sigterm_lets_a_short_stream_finish_and_ends_what_the_shutdown_timeout_cuts_with_an_error(server):
    """On SIGTERM the server stops accepting; a stream that ends within --shutdown-timeout ends as usual, and
    requests still open when the timeout runs out end with an error (a stream's last event, a plain request's
    503), not a cut connection; then the process exits 0."""
    proc, url, log = server
    result, first_chunk = {}, {"short": threading.Event(), "long": threading.Event()}
    # the short stream's few tokens fit the timeout many times over; the long requests' far more tokens do not
    short = {"prompt": "Once upon a time", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    long = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

    def stream(name: str, body: dict):
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
            lines = []
            for line in resp.iter_lines():
                lines.append(line)
                first_chunk[name].set()
            result[name] = lines

    def plain():
        result["plain"] = httpx.post(url + "/v1/completions", json=long, timeout=120)

    readers = [threading.Thread(target=stream, args=("short", short)),
               threading.Thread(target=stream, args=("long", long)), threading.Thread(target=plain)]
    for r in readers:
        r.start()
    assert first_chunk["short"].wait(60) and first_chunk["long"].wait(60)
    proc.send_signal(signal.SIGTERM)
    for r in readers:
        r.join(120)
    assert proc.wait(60) == 0, log.read_text()  # a clean shutdown is a normal exit, not death by the signal
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text
    lines = [line for line in result["short"] if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    lines = [line for line in result["long"] if line]
    assert lines[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
    assert result["plain"].status_code == 503 and "shutting down" in result["plain"].json()["error"]["message"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, True),  # a server maps its KV cache at start by default
    (["--no-kv-cache-prefault"], {}, False),  # the flag wins
    ([], {"PAGODA_KV_CACHE_PREFAULT": "0"}, None),  # the variable wins (resolved with the other host settings)
])
def test_a_server_maps_its_kv_cache_at_start_unless_told_not_to(argv, environ, expected):
    from pagoda.cli import build_parser
    from pagoda.plugins.entrypoints.cli.serve import apply_server_defaults

    ns = build_parser().parse_args(["serve", *argv])
    apply_server_defaults(ns, environ)
    assert ns.kv_cache_prefault is expected
