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


def start_process(log: Path, *args: str, timeout: float = 180, port: int | None = None, env: dict | None = None,
                  ready_line: str | None = None) -> tuple[subprocess.Popen, str]:
    """``pagoda ARGS --port P`` (a free port unless ``port``) with its output in ``log``, in ``env`` (this process's
    environment at import and one CPU thread unless given); returned once ``/health`` answers 200 and, with
    ``ready_line``, once the log has that line. Fails the test with the log if it dies or is not ready past
    ``timeout`` seconds."""
    port = port or free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([PAGODA, *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env=env or ENV)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    # one client for the polls: each httpx.get builds its own and loads the CA bundle (~40 ms of CPU a poll)
    with httpx.Client(timeout=5) as client:
        while True:
            if ready_line is None or ready_line in log.read_text():
                try:
                    if client.get(url + "/health").status_code == 200:
                        return proc, url
                except httpx.HTTPError:
                    pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"pagoda {' '.join(args)} did not become ready:\n{log.read_text()[-4000:]}")
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
    message = ""
    try:
        returncode = main(list(args))
    except SystemExit as exc:
        # as the interpreter exits: None is 0, an int the status, anything else printed to stderr with status 1
        if exc.code is None or isinstance(exc.code, int):
            returncode = exc.code or 0
        else:
            returncode, message = 1, f"{exc.code}\n"
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["pagoda", *args], returncode, out.out, out.err + message)
