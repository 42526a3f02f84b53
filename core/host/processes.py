"""Helper processes that run pagoda's code alone: forked by multiprocessing's fork server (tensor- and
pipeline-parallel ranks, grammar compile processes) without running the program's script again.

multiprocessing prepares every process it starts by running the parent's ``__main__`` again in it (as
``__mp_main__``), so that functions defined there can be found. A quick script builds its engine at its top level,
with no ``if __name__ == "__main__":``; run again in a rank or a compile process it would build another engine
there, which fails (multiprocessing refuses to start a process from one still starting). pagoda's helper processes
run only pagoda's functions on pagoda's objects, so they skip that step: :class:`ForkedProcess` starts a process
without the parent's ``__main__`` in what the child prepares.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from multiprocessing import popen_forkserver
from multiprocessing.context import ForkServerProcess
from typing import Any, Iterator

_MAIN_LOCK = threading.Lock()


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """Within the block, ``__main__`` has neither a file nor a module spec, which is what multiprocessing reads to
    decide whether a child runs the program's script again (and it then does not). Restored on exit."""
    main = sys.modules.get("__main__")
    with _MAIN_LOCK:
        if main is None:
            yield
            return
        saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj: Any) -> None:
        with main_script_hidden():
            super()._launch(process_obj)


class ForkedProcess(ForkServerProcess):
    """A ``multiprocessing`` process forked by the fork server (``get_context("forkserver")``, whose preload list
    applies) that does not run the program's ``__main__`` again: its target and arguments must be importable from
    modules other than ``__main__``."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)
