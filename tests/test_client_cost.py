"""contrib/serving-comparison/client_cost.py against a real uvicorn server on 127.0.0.1 (a tiny random Llama with
the default model's tokenizer): both clients' streams timed and their CPU counted, in alternated runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from one_engine import release
from tiny_models import write_tiny_llama

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app

SCRIPT = Path(__file__).resolve().parents[1] / "contrib" / "serving-comparison" / "client_cost.py"


@pytest.fixture(scope="module")
def client_cost():
    spec = importlib.util.spec_from_file_location("client_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_clients_stream_every_request_and_the_table_compares_them(client_cost, tmp_path, capsys):
    model = write_tiny_llama(tmp_path, chat_template=True)
    # the counters `pagoda serve` keeps, which the offline LLM leaves off: the engine time per token is read from them
    llm = LLM(model=str(model), dtype="float32", cpu_threads=1, kv_cache_memory_bytes=16 << 20, max_model_len=256,
              disable_log_stats=False)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    try:
        assert client_cost.main(["--base-url", srv.url, "--tokenizer", str(ensure_default_model()),
                                 "--num-prompts", "4", "--request-rate", "50", "--rounds", "1"]) == 0
    finally:
        srv.stop()
        release(llm)
    out = capsys.readouterr().out
    runs = [line.split(" ", 1)[0] for line in out.splitlines() if line.startswith(("aiohttp {", "openai {"))]
    assert runs == ["aiohttp", "openai", "openai", "aiohttp"]
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    for label in ("output tok/s", "mean TTFT (ms)", "mean TPOT (ms)", "p99 TPOT (ms)", "client CPU for the run (s)",
                  "engine time per token (ms; pagoda's /metrics)"):
        aiohttp_value, openai_value = (float(v) for v in rows[label].split(" | ")[1:3])
        assert aiohttp_value > 0 and openai_value > 0, rows[label]


def test_bad_options_are_refused(client_cost, capsys):
    with pytest.raises(SystemExit) as refused:
        client_cost.main(["--rounds", "0"])
    assert refused.value.code == 2 and "must be above 0" in capsys.readouterr().err
