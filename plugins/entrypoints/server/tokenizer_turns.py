"""The server's tokenizer thread, shared fairly: each request's tokenizing is cut into turns taken in rotation."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, TypeVar

# a request whose prompts hold at most this many characters (or token ids) in all is tokenized at once on the event
# loop (0.2 ms for a 128-token prompt) rather than handed to the tokenizer thread and back, which took 2-9 ms on
# two cores busy with the engine's threads
MAX_INLINE_CHARS = 2048

Item = TypeVar("Item")
Result = TypeVar("Result")


class TokenizerTurns:
    """One thread with a tokenizer of its own, on which requests take turns.

    A fast tokenizer must not be used by two threads at once, and tokenizing must stay off the event loop and
    the engine's thread; so every tokenizing, chat-template rendering and detokenizing of the server runs on
    this one thread. To keep a large request from holding it, a request's work is cut into turns, each bounded:
    one prompt of a completions request (at most the per-prompt character limit, ``max_model_len`` times the
    longest token), one chat rendering with its encoding (the same limit), one ``/detokenize`` call (at most
    ``MAX_TOKEN_IDS`` ids). A request queues its next turn only when its previous one is done, and the thread
    takes turns in the order they were queued; so the requests waiting take turns round-robin, and a request
    that arrives while a 64-prompt request is being tokenized waits for one of its prompts, not for all of
    them. A request whose client has gone is cancelled between turns (the rest of its turns never run).

    Turns are whole prompts, not pieces of one: a prompt cut at any character may encode to other tokens than
    the whole prompt does, so the turn is as small as tokenizing can be cut exactly.

    A request too small to be worth the hand-offs (:meth:`run_now`) is tokenized on the event loop, with a
    tokenizer of the loop's own: its work there is bounded by ``MAX_INLINE_CHARS``.
    """

    def __init__(self, tokenizer: Any, loop_tokenizer: Optional[Any] = None) -> None:
        """``loop_tokenizer``: a tokenizer used on the event loop only (a server's output side has one), else a
        copy of ``tokenizer`` is made for :meth:`run_now`."""
        self.tokenizer = tokenizer  # used on the thread only
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-tokenizer")
        # used on the event loop only (run_now)
        self._loop_tokenizer = loop_tokenizer if loop_tokenizer is not None else copy.deepcopy(tokenizer)

    async def run(self, fn: Callable[[Any], Result]) -> Result:
        """``fn(tokenizer)`` as one turn on the thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, self.tokenizer)

    def run_now(self, fn: Callable[[Any, Item], Result], items: list[Item], num_chars: int) -> Optional[list[Result]]:
        """``[fn(tokenizer, item) for item in items]`` at once on the event loop when the items hold at most
        ``MAX_INLINE_CHARS`` characters or token ids in all (``num_chars``); None, doing nothing, when they hold
        more (:meth:`run_each` takes them)."""
        if num_chars > MAX_INLINE_CHARS:
            return None
        return [fn(self._loop_tokenizer, item) for item in items]

    async def run_each(self, fn: Callable[[Any, Item], Result], items: Iterable[Item]) -> list[Result]:
        """``[fn(tokenizer, item) for item in items]``, one turn per item: other requests' turns come between."""
        results = []
        for item in items:
            results.append(await self.run(lambda tokenizer, item=item: fn(tokenizer, item)))
        return results
