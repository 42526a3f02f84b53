"""xgrammar compiles in worker processes of their own, so that a compile can be stopped: xgrammar's compiler is
C++ that no thread can interrupt, and a schema can take minutes. A stopped compile's process is killed and a
new one started for the next compile; a finished compile comes back as xgrammar's serialized grammar."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any, Callable, Optional

from pagoda.errors import InvalidRequestError
from pagoda.host.processes import ForkedProcess

POLL_SECONDS = 0.05  # how often a waiting compile asks whether it should stop


class CompileStopped(Exception):
    """A compile given up before it finished (its time ran out, or no request waits for it any more)."""


def _serve(conn: Any, tokenizer_info_json: str) -> None:
    """The worker process: compile each (method, args, kwargs) received; answer ("ok", serialized grammar) or
    ("error", message)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        conn.send(("ready", None))
        while True:
            method, args, kwargs = conn.recv()
            try:
                answer = ("ok", getattr(compiler, method)(*args, **kwargs).serialize_json())
            except Exception as exc:  # noqa: BLE001 - any compiler error is the request's, told back as text
                answer = ("error", str(exc).strip() or type(exc).__name__)
            conn.send(answer)
    except (EOFError, BrokenPipeError):
        return  # the engine closed its end: shutting down


class CompileProcessFailed(RuntimeError):
    """A compile process exited before it could take a compile."""


class _Worker:
    def __init__(self, context: Any, tokenizer_info_json: str) -> None:
        self.conn, child_conn = context.Pipe()
        # (a process that does not run the program's script again: see pagoda.host.processes)
        self.process = ForkedProcess(target=_serve, args=(child_conn, tokenizer_info_json), daemon=True,
                                     name="pagoda-grammar-compile")
        self.process.start()
        child_conn.close()
        self.is_ready = False

    def wait_ready(self, should_stop: Callable[[float], bool]) -> None:
        """Wait until the process has started (its imports take seconds); CompileStopped if the compile is
        given up meanwhile (the start does not count as compiling time); CompileProcessFailed if the process
        exits first."""
        while not self.is_ready:
            if self.conn.poll(POLL_SECONDS):
                try:
                    self.conn.recv()
                except (EOFError, OSError):
                    raise self._failed() from None
                self.is_ready = True
            elif should_stop(0.0):
                raise CompileStopped()
            elif not self.process.is_alive():
                raise self._failed()

    def _failed(self) -> CompileProcessFailed:
        self.process.join(5)
        return CompileProcessFailed(f"the grammar compile process exited before it started (exit code "
                                    f"{self.process.exitcode}); its error, if any, is on the server's stderr")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class CompileProcesses:
    """``num_processes`` xgrammar compile processes for one tokenizer, started at once in the background; a
    killed one is replaced at once."""

    def __init__(self, tokenizer_info: Any, num_processes: int) -> None:
        self._info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json()
        # the server's threads make a plain fork unsafe; a fork server (one process that imported xgrammar, a
        # start of seconds, once) forks each worker in milliseconds, so a killed one is replaced at once
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["xgrammar", __name__])
        self._idle = [_Worker(self._context, self._info_json) for _ in range(num_processes)]
        self._lock = threading.Lock()

    def compile(self, method: str, args: tuple, kwargs: dict, should_stop: Callable[[float], bool]) -> Any:
        """xgrammar's ``GrammarCompiler.<method>(*args, **kwargs)`` compiled in a worker process; RuntimeError
        with the compiler's message when it refuses the input; CompileStopped (the worker killed and replaced)
        once ``should_stop(seconds spent compiling)`` is true."""
        import xgrammar

        worker = self._take()
        try:
            worker.wait_ready(should_stop)
            worker.conn.send((method, args, kwargs))
            start = time.monotonic()
            while not worker.conn.poll(POLL_SECONDS):
                if should_stop(time.monotonic() - start) or not worker.process.is_alive():
                    raise CompileStopped()
            status, payload = worker.conn.recv()
        except BaseException:
            worker.kill()
            with self._lock:
                self._idle.append(_Worker(self._context, self._info_json))
            raise
        with self._lock:
            self._idle.append(worker)
        if status == "error":
            raise RuntimeError(payload)
        return xgrammar.CompiledGrammar.deserialize_json(payload, self._info)

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take(self) -> _Worker:
        with self._lock:
            # a started process first
            for i, worker in enumerate(self._idle):
                if worker.is_ready:
                    return self._idle.pop(i)
            if self._idle:
                return self._idle.pop(0)
        return _Worker(self._context, self._info_json)


def stopped_error(param: str, timeout: float) -> InvalidRequestError:
    """The 400 of a compile that ran out of time."""
    return InvalidRequestError(
        f"{param} took longer than {timeout:g} s to compile and was stopped; send a smaller schema, regex or "
        "grammar (fewer properties, smaller repetition bounds), or raise the server's "
        "--structured-outputs-compile-timeout", param=param)
