"""A real ``pagoda`` server process for tests: started on a free port, returned once ``/health`` answers 200."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.plugins.entrypoints.server import free_port

PAGODA = str(Path(sys.executable).with_name("pagoda"))
ENV = {**os.environ, "PAGODA_CPU_THREADS": "1"}


def start_process(log: Path, *args: str, timeout: float = 180) -> tuple[subprocess.Popen, str]:
    """``pagoda ARGS --port P`` with its output in ``log``; fails the test with the log if it dies or stays
    unhealthy past ``timeout`` seconds."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([PAGODA, *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=ENV)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    # one client for the polls: each httpx.get builds its own and loads the CA bundle (~40 ms of CPU a poll)
    with httpx.Client(timeout=5) as client:
        while True:
            try:
                if client.get(url + "/health").status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"pagoda {args[0]} did not become healthy:\n{log.read_text()}")
            time.sleep(0.3)


def start_server(log: Path, *flags: str, kv_cache_bytes: int = 64 << 20) -> tuple[subprocess.Popen, str]:
    """``pagoda serve`` in float32 with a small KV cache (the default model unless ``flags`` name one)."""
    return start_process(log, "serve", "--dtype", "float32", "--kv-cache-memory-bytes", str(kv_cache_bytes),
                         "--uvicorn-log-level", "warning", *flags)


def run_pagoda_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``pagoda ARGS`` through the console script's entry point in this process: a CompletedProcess with its exit
    status (argparse's exits included) and its output, as the command's own process would give them."""
    from pagoda.cli import main

    capsys.readouterr()
    try:
        returncode = main(list(args))
    except SystemExit as exc:
        returncode = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["pagoda", *args], returncode, out.out, out.err)
