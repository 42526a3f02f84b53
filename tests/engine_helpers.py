"""Checks the server and async-engine tests share."""

import time


def wait_until_cache_is_free(llm, timeout: float = 10.0) -> bool:
    """Whether, within ``timeout`` seconds, ``llm``'s engine holds no request and no KV block (the engine thread
    frees an aborted request's blocks between two steps)."""
    engine = getattr(llm, "engine", llm)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.kv_manager.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False
