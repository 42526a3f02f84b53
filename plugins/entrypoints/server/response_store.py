"""Responses kept in memory, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Each response keeps only what it added to its conversation (its input items and its output items) and the
id of the response it continued, so a conversation of n turns costs n entries, not n copies of its history.
The store is bounded three ways, always dropping the least recently used response first: a number of
responses, a budget of characters, and an expiry ``ttl_seconds`` after a response was last used (stored,
read, or continued). Everything runs on the server's event loop; there is no lock.

Each response belongs to its owner (the server's API key or tenant of the request that stored it): another
owner's id reads as not stored, and each owner has a quota (``max_per_owner`` responses and that share of the
characters), so one owner storing many responses evicts its own, not others'.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_TTL_SECONDS = 3600.0
DEFAULT_MAX_CHARS = 128 << 20  # characters of text and JSON across all stored responses
OWNER_SHARE = 10  # by default an owner may keep a tenth of the responses and of the characters


class ResponseNotStored(LookupError):
    """A response id that the store does not hold (never stored, deleted, expired or evicted)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass
class StoredResponse:
    """One finished response and its part of the conversation, as items of the Responses API with their text
    (``{"type": "message", "role", "content": text}``, ``function_call``, ``function_call_output``)."""

    response: dict  # the response object as it was answered
    items: list[dict]  # this request's input items, without its instructions
    output: list[dict]  # its output items
    previous_response_id: Optional[str]
    owner: str = ""  # who stored it (set by the store)
    num_chars: int = field(init=False)
    last_used: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.num_chars = sum(len(json.dumps(part, ensure_ascii=False)) for part in (self.response, self.items,
                                                                                     self.output))


class ResponseStore:
    """Finished responses by id, least recently used first."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_seconds: float = DEFAULT_TTL_SECONDS,
                 max_chars: int = DEFAULT_MAX_CHARS, clock: Callable[[], float] = time.monotonic,
                 max_per_owner: Optional[int] = None) -> None:
        if max_responses < 0 or ttl_seconds <= 0 or max_chars < 0:
            raise ValueError(f"the response store needs max_responses >= 0 (got {max_responses}), ttl_seconds > 0 "
                             f"(got {ttl_seconds}) and max_chars >= 0 (got {max_chars})")
        self.max_responses, self.ttl_seconds, self.max_chars = max_responses, ttl_seconds, max_chars
        # an owner's quota: responses, and characters in the same proportion
        self.max_per_owner = max_per_owner if max_per_owner is not None else max(1, max_responses // OWNER_SHARE)
        self.max_chars_per_owner = max_chars * self.max_per_owner // max(1, max_responses)
        self._num_per_owner: dict[str, int] = {}
        self._chars_per_owner: dict[str, int] = {}
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_chars = 0

    @property
    def is_enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        self._drop_expired()
        return len(self._entries)

    def can_store(self, entry: StoredResponse) -> bool:
        return self.is_enabled and entry.num_chars <= min(self.max_chars, self.max_chars_per_owner)

    def for_owner(self, owner: Optional[str]) -> "OwnedResponses":
        """This store as ``owner`` sees it."""
        return OwnedResponses(self, owner or "")

    def store(self, response_id: str, entry: StoredResponse, owner: str = "") -> None:
        """Keep ``entry`` as ``owner``'s, dropping the owner's least recently used responses past its quota,
        then anyone's past the store's bounds."""
        if not self.can_store(entry):
            return
        self._drop_expired()
        self._pop(response_id)
        entry.owner, entry.last_used = owner, self._clock()
        self._entries[response_id] = entry
        self._num_chars += entry.num_chars
        self._num_per_owner[owner] = self._num_per_owner.get(owner, 0) + 1
        self._chars_per_owner[owner] = self._chars_per_owner.get(owner, 0) + entry.num_chars
        while (self._num_per_owner[owner] > self.max_per_owner
               or self._chars_per_owner[owner] > self.max_chars_per_owner):
            self._pop(next(i for i, e in self._entries.items() if e.owner == owner))
        while len(self._entries) > self.max_responses or self._num_chars > self.max_chars:
            self._pop(next(iter(self._entries)))

    def get(self, response_id: str, owner: str = "") -> StoredResponse:
        """``owner``'s stored response (now its most recent use); :class:`ResponseNotStored` if there is none."""
        entry = self._peek(response_id, owner)
        self._touch(response_id, entry)
        return entry

    def delete(self, response_id: str, owner: str = "") -> None:
        self._peek(response_id, owner)
        self._pop(response_id)

    def conversation(self, response_id: str, owner: str = "") -> list[dict]:
        """The items of the conversation up to and including response ``response_id``'s output, oldest first:
        each response's input items, then its output items. Every response on the way counts as used;
        :class:`ResponseNotStored` names the first one missing (or not ``owner``'s)."""
        chain = []
        next_id: Optional[str] = response_id
        while next_id is not None:
            entry = self._peek(next_id, owner)
            chain.append((next_id, entry))
            next_id = entry.previous_response_id
        items = []
        for entry_id, entry in reversed(chain):  # oldest first, so the newest response is the last one used
            self._touch(entry_id, entry)
            items += entry.items + entry.output
        return items

    def _peek(self, response_id: str, owner: str) -> StoredResponse:
        self._drop_expired()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:  # another owner's id reads as not stored
            raise ResponseNotStored(response_id)
        return entry

    def _touch(self, response_id: str, entry: StoredResponse) -> None:
        entry.last_used = self._clock()
        self._entries.move_to_end(response_id)

    def _pop(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._num_chars -= entry.num_chars
            self._num_per_owner[entry.owner] -= 1
            self._chars_per_owner[entry.owner] -= entry.num_chars
            if not self._num_per_owner[entry.owner]:
                del self._num_per_owner[entry.owner], self._chars_per_owner[entry.owner]
        return entry

    def _drop_expired(self) -> None:
        # last use is the order of the entries, so the expired ones are at the front
        deadline = self._clock() - self.ttl_seconds
        while self._entries and next(iter(self._entries.values())).last_used <= deadline:
            self._pop(next(iter(self._entries)))


class OwnedResponses:
    """A :class:`ResponseStore` as one owner sees it: the owner's responses only."""

    def __init__(self, store: ResponseStore, owner: str) -> None:
        self._store, self.owner = store, owner
        self.is_enabled, self.max_responses = store.is_enabled, store.max_responses
        self.ttl_seconds, self.max_per_owner = store.ttl_seconds, store.max_per_owner

    def store(self, response_id: str, entry: StoredResponse) -> None:
        self._store.store(response_id, entry, self.owner)

    def get(self, response_id: str) -> StoredResponse:
        return self._store.get(response_id, self.owner)

    def delete(self, response_id: str) -> None:
        self._store.delete(response_id, self.owner)

    def conversation(self, response_id: str) -> list[dict]:
        return self._store.conversation(response_id, self.owner)
