"""A client that gives up on a non-streamed request once the engine is running it (not after a fixed wait)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx


def post_and_leave_while_running(llm, url: str, body: dict, headers: dict | None = None,
                                 timeout: float = 30.0) -> None:
    """POST ``body`` to ``url`` and close the connection unanswered as soon as ``llm``'s engine holds KV blocks
    (the request is running); fails if it is answered first or holds none within ``timeout`` seconds."""
    engine = getattr(llm, "engine", llm)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=timeout) as client:
            answer = asyncio.ensure_future(client.post(url, json=body, headers=headers))
            deadline = time.monotonic() + timeout
            while engine.kv_manager.num_free_blocks == engine.num_blocks:
                assert not answer.done(), "the request was answered before the client could leave"
                assert time.monotonic() < deadline, f"the engine held no KV block within {timeout} s"
                await asyncio.sleep(0.01)
            assert not answer.done(), "the request was answered before the client could leave"
            answer.cancel()  # closes the connection mid-request
            with contextlib.suppress(asyncio.CancelledError):
                await answer

    asyncio.run(run())
