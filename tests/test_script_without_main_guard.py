"""A plain script's engine: its helper processes (tensor-parallel ranks, grammar compile processes) never run the
program's script again (multiprocessing re-runs ``__main__`` in the processes it starts, and a quick script builds
its engine at the top level, with no ``if __name__ == "__main__":``); a helper process that cannot start is
reported with its exit code (for a compile process, the server's failure, not the request's)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from tiny_models import write_tiny_llama

from pagoda.errors import PagodaError
from pagoda.execution.executor import _wait_started
from pagoda.host.processes import ForkedProcess
from pagoda.sampling.structured.compile_process import CompileProcesses, CompileProcessFailed

# a length-bounded string: a random model's greedy answer held a raw control character there, which xgrammar
# allows in such strings and a strict JSON parser refuses (pagoda's xgrammar backend keeps them out)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def test_a_script_without_a_main_guard_gets_its_json_from_two_ranks(tmp_path):
    (tmp_path / "model").mkdir()
    model = write_tiny_llama(tmp_path / "model")
    script = tmp_path / "quick.py"
    # the script announces each run of its top level: the compile processes must not run it
    script.write_text(textwrap.dedent(f"""
        import json
        from pagoda import LLM, SamplingParams
        from pagoda.sampling_params import StructuredOutputsParams
        print("top level ran", flush=True)
        llm = LLM(model={str(model)!r}, dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20)
        params = SamplingParams(max_tokens=40, temperature=0,
                                structured_outputs=StructuredOutputsParams(json={SCHEMA!r}))
        print("ANSWER", llm.generate(["A city:"], params, use_tqdm=False)[0].outputs[0].text, flush=True)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("top level ran") == 1
    (answer,) = [line[len("ANSWER "):] for line in run.stdout.splitlines() if line.startswith("ANSWER ")]
    parsed = json.loads(answer)  # complete and valid: the grammar held every token
    assert set(parsed) == {"city"} and len(parsed["city"]) <= 12


class _UnreadableTokenizerInfo:
    """A tokenizer description no compile process can read: the process exits while it starts."""

    def serialize_json(self) -> str:
        return "{not json"


def test_a_compile_process_that_cannot_start_is_reported_with_its_exit_code():
    processes = CompileProcesses(_UnreadableTokenizerInfo(), 1)
    try:
        with pytest.raises(CompileProcessFailed) as failed:
            processes.compile("compile_json_schema", ('{"type": "string"}',), {}, lambda seconds: seconds > 60)
        assert "exited before it started (exit code 1)" in str(failed.value)
    finally:
        processes.shutdown()


def test_a_rank_that_exits_while_starting_is_reported_at_once_with_its_exit_code():
    import multiprocessing
    import os
    import time

    ours, theirs = multiprocessing.get_context("forkserver").Pipe()
    rank = ForkedProcess(target=os._exit, args=(3,), daemon=True)
    rank.start()
    theirs.close()
    start = time.monotonic()
    with pytest.raises(PagodaError) as refused:
        _wait_started([ours], [rank], timeout=120)
    assert time.monotonic() - start < 60  # not the start timeout
    assert str(refused.value) == (f"tensor-parallel rank 1 (process {rank.pid}) exited with code 3 while starting, "
                                  "before it built its shard; its error is on stderr")


def test_a_server_whose_compile_process_cannot_start_answers_500_and_serves_on(tmp_path):
    """The server's failure, said as such: a 500 naming the exit code, not a 400 blaming the schema; plain requests
    still served."""
    import httpx

    from one_engine import release
    from pagoda import LLM
    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.plugins.entrypoints.server import ServerThread, build_app

    (tmp_path / "model").mkdir()
    llm = LLM(model=str(write_tiny_llama(tmp_path / "model")), dtype="float32", cpu_threads=1,
              kv_cache_memory_bytes=8 << 20, max_model_len=128)
    from pagoda import SamplingParams, StructuredOutputsParams

    # a first constraint builds the xgrammar backend; then its compile processes are ones that cannot start
    llm.generate(["A"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[ab]+")),
                 use_tqdm=False)
    backend = llm.engine.structured_outputs._backends["xgrammar"]
    backend.processes.shutdown()
    backend.processes = CompileProcesses(_UnreadableTokenizerInfo(), 1)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    try:
        body = {"model": srv_model(srv.url), "prompt": "A city:", "max_tokens": 4,
                "structured_outputs": {"json": SCHEMA, "backend": "xgrammar"}}
        reply = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 500, reply.text
        assert "grammar compile process exited before it started (exit code 1)" in reply.json()["error"]["message"]
        plain = httpx.post(srv.url + "/v1/completions", json={"model": body["model"], "prompt": "A city:",
                                                              "max_tokens": 4}, timeout=120)
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
        release(llm)


def srv_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
