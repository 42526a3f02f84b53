"""The in-memory store of /v1/responses: conversations rebuilt from their responses, and its three bounds."""

from __future__ import annotations

import pytest

from pagoda.plugins.entrypoints.server.response_store import (DEFAULT_MAX_RESPONSES, ResponseNotStored, ResponseStore,
                                                              StoredResponse)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def message(role: str, text: str) -> dict:
    return {"type": "message", "role": role, "content": text}


def entry(user: str, answer: str, previous=None) -> StoredResponse:
    return StoredResponse({"output_text": answer}, [message("user", user)], [message("assistant", answer)], previous)


def test_a_conversation_is_rebuilt_from_the_chain_of_responses_oldest_first():
    store = ResponseStore()
    store.store("r1", entry("Hi", "Hello!"))
    store.store("r2", entry("Name a color", "Blue", previous="r1"))
    store.store("r3", entry("Another", "Red", previous="r2"))
    assert store.conversation("r3") == [
        message("user", "Hi"), message("assistant", "Hello!"), message("user", "Name a color"),
        message("assistant", "Blue"), message("user", "Another"), message("assistant", "Red")]
    assert store.conversation("r1") == [message("user", "Hi"), message("assistant", "Hello!")]


def test_function_calls_and_their_outputs_are_kept_in_the_order_of_the_conversation():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}
    store = ResponseStore()
    store.store("r1", StoredResponse({}, [message("user", "Weather in Paris?")], [call], None))
    store.store("r2", StoredResponse({}, [result], [message("assistant", "It is 18 degrees.")], "r1"))
    assert store.conversation("r2") == [message("user", "Weather in Paris?"), call, result,
                                        message("assistant", "It is 18 degrees.")]


def test_a_missing_link_names_the_response_that_is_gone():
    store = ResponseStore()
    store.store("r1", entry("Hi", "Hello!"))
    store.store("r2", entry("Again", "Yes", previous="r1"))
    store.delete("r1")
    with pytest.raises(ResponseNotStored) as info:
        store.conversation("r2")
    assert info.value.response_id == "r1"
    with pytest.raises(ResponseNotStored):
        store.delete("r1")


def test_past_the_count_the_least_recently_used_response_is_dropped():
    store = ResponseStore(max_responses=2, max_per_owner=2)
    store.store("a", entry("1", "x"))
    store.store("b", entry("2", "y"))
    store.get("a")  # a is now used more recently than b
    store.store("c", entry("3", "z"))
    assert len(store) == 2
    assert store.get("a") and store.get("c")
    with pytest.raises(ResponseNotStored):
        store.get("b")


def test_continuing_a_conversation_keeps_its_oldest_responses_the_longest():
    store = ResponseStore(max_responses=3, max_per_owner=3)
    store.store("r1", entry("1", "x"))
    store.store("r2", entry("2", "y", previous="r1"))
    store.store("other", entry("3", "z"))
    store.conversation("r2")  # uses r1 then r2: "other" is now the least recently used
    store.store("r3", entry("4", "w", previous="r2"))
    assert len(store.conversation("r3")) == 6
    with pytest.raises(ResponseNotStored):
        store.get("other")


def test_past_the_character_budget_old_responses_are_dropped_and_a_too_large_one_is_not_kept():
    small = entry("a" * 10, "b" * 10)
    store = ResponseStore(max_chars=3 * small.num_chars, max_per_owner=DEFAULT_MAX_RESPONSES)
    for i in range(5):
        store.store(f"r{i}", entry("a" * 10, "b" * 10))
    assert len(store) == 3
    huge = entry("a" * 10_000, "b")
    assert not store.can_store(huge)
    store.store("huge", huge)
    with pytest.raises(ResponseNotStored):
        store.get("huge")
    assert len(store) == 3


def test_a_response_expires_ttl_seconds_after_its_last_use():
    clock = Clock()
    store = ResponseStore(ttl_seconds=60, clock=clock)
    store.store("a", entry("1", "x"))
    store.store("b", entry("2", "y"))
    clock.now += 50
    store.get("a")  # used again: a lives 60 s from now
    clock.now += 20
    assert store.get("a")
    with pytest.raises(ResponseNotStored):
        store.get("b")
    clock.now += 61
    assert len(store) == 0


def test_a_store_of_size_zero_keeps_nothing_and_bad_bounds_are_refused():
    store = ResponseStore(max_responses=0)
    store.store("a", entry("1", "x"))
    assert not store.is_enabled and len(store) == 0
    with pytest.raises(ValueError, match="ttl_seconds > 0"):
        ResponseStore(ttl_seconds=0)


def test_another_owner_s_response_reads_as_not_stored():
    store = ResponseStore()
    alice, bob = store.for_owner("alice"), store.for_owner("bob")
    alice.store("r1", entry("Hi", "Hello!"))
    alice.store("r2", entry("More", "Sure", previous="r1"))
    for action in (bob.get, bob.delete, bob.conversation, store.for_owner(None).get):
        with pytest.raises(ResponseNotStored):
            action("r2")
    assert len(alice.conversation("r2")) == 4
    alice.delete("r2")
    with pytest.raises(ResponseNotStored):
        alice.get("r2")


def test_an_owner_past_its_quota_evicts_its_own_responses_not_others():
    store = ResponseStore(max_responses=10)  # a tenth each: one response per owner
    assert store.max_per_owner == 1
    store.for_owner("alice").store("a", entry("1", "x"))
    for i in range(20):
        store.for_owner("mallory").store(f"m{i}", entry("2", "y"))
    assert store.for_owner("alice").get("a")
    assert store.for_owner("mallory").get("m19")
    with pytest.raises(ResponseNotStored):
        store.for_owner("mallory").get("m18")
