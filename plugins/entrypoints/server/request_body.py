"""What a request body may hold: the base model of every body, and the bounds its fields share.

Every request model derives from :class:`RequestBody`: strict types, no field outside the schema, and no
string (a field, an item of a list, a key or value of a JSON object) with an unpaired UTF-16 surrogate, which
JSON can carry as ``"\\ud800"`` but no tokenizer, template or JSON encoder can take. The bounds below are
pydantic constraints, so the OpenAPI document shows them (``maxItems``, ``maxLength``, ``maxProperties``) and
a body past one gets a 400 naming the field before any work is done for it. They are far above what real
clients send; what bounds the cost of a request is ``--max-request-bytes``, these bounds, and the characters
a request may have for the tokenizer (``--max-request-chars``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

MAX_PROMPTS = 64  # prompts of one completions request
# token ids of one prompt or one /detokenize call: more than any context a CPU engine serves
MAX_TOKEN_IDS = 1 << 17
MAX_STOP = 16  # stop strings of one request
MAX_STOP_CHARS = 4096  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # token ids given a bias
MAX_MESSAGES = 4096  # chat messages, Responses input items
MAX_CONTENT_PARTS = 256  # parts of one message's content
MAX_TOOLS = 128  # function tools of one request
MAX_TOOL_CALLS = 128  # tool calls of one assistant message
MAX_CHOICES = 1024  # strings of a guided choice
MAX_NAME_CHARS = 256  # a message's participant name
# identifiers: the model, user, tool call ids, response ids, cache keys
MAX_ID_CHARS = 512
MAX_SHORT_LIST = 16  # lists with a handful of meaningful items: modalities, include, ...
MAX_ANNOTATIONS = 1024  # annotations of an output_text part sent back as input
# OpenAI's bounds of metadata: 16 pairs, keys of 64 characters, values of 512
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# how deep JSON arrays and objects may nest in a body: JSON schemas of structured outputs and tools nest a
# few levels per schema level, and OpenAI allows schemas 10 levels deep
MAX_JSON_DEPTH = 128


def list_bound(max_items: int, min_items: int = 0) -> FieldInfo:
    """The bound of a list field: at most ``max_items`` items (at least ``min_items``), and validation stops at
    the first bad item: a list of 100,000 bad items is one error, not 100,000 (each costs microseconds, on the
    event loop)."""
    return Field(min_length=min_items, max_length=max_items, fail_fast=True)


class RequestBody(BaseModel):
    """The base of every request body: strict, no unknown fields, valid Unicode in every string."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        found = unpaired_surrogate(value)
        if found is not None:
            where, char, index = found
            raise ValueError(f"contains an unpaired UTF-16 surrogate ({char!a}) at character {index}{where}; send "
                             "valid Unicode text (a JSON \\ud800-\\udbff escape must be followed by a "
                             "\\udc00-\\udfff one)")
        return value


_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def unpaired_surrogate(value: Any, path: str = "") -> Optional[tuple[str, str, int]]:
    """The first unpaired surrogate in the strings of ``value`` (a string, or JSON arrays and objects of them):
    ``(where, the surrogate, its index)``, ``where`` naming the item (`` of [2].name``) or ``""``; None when
    there is none. JSON decoding joins a valid pair into one character, so any surrogate left is unpaired.
    Nested models are skipped: their own validators check them."""
    if isinstance(value, str):
        if value.isascii():  # CPython knows this without a scan
            return None
        match = _SURROGATE.search(value)
        return None if match is None else (f" of {path}" if path else "", match.group(), match.start())
    if isinstance(value, dict):
        for key, item in value.items():
            found = unpaired_surrogate(key, f"a key of {path or 'the object'}") or unpaired_surrogate(
                item, f"{path}[{key!a}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _SCALAR_TYPES:  # token ids and the like, at C speed
            return None
        for i, item in enumerate(value):
            found = unpaired_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


# a JSON string, escapes included; what is left around strings holds the brackets that nest
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CHUNK = 1 << 20


def json_nesting_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``body`` nests arrays and objects deeper than ``limit`` levels, found without
    parsing it (parsers recurse per level): in C over the bytes, a few milliseconds per megabyte of brackets.
    Brackets in strings do not count; a body that is not JSON may give either answer (its parse fails)."""
    if body.count(b"[") + body.count(b"{") <= limit:  # the common case: no scan at all
        return False
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    depth = 0
    for start in range(0, len(brackets), _CHUNK):
        chunk = brackets[start:start + _CHUNK]
        # "[" 0x5b and "{" 0x7b open, "]" 0x5d and "}" 0x7d close: the bit of value 2 tells them apart
        steps = (chunk & 2).astype(np.int32) - 1
        levels = np.cumsum(steps) + depth
        if levels.max() > limit:
            return True
        depth = int(levels[-1])
    return False


class UnusableJSON(ValueError):
    """A JSON text inside a field that the server will not use: why, in words that follow "the text ..."."""


def load_json_text(text: str) -> Any:
    """A JSON text sent inside a string field (tool call arguments, a schema), parsed and held to the bounds of a
    body: :class:`UnusableJSON` when it nests more than ``MAX_JSON_DEPTH`` levels or has an unpaired surrogate
    (escaped in the text, so the body's own check cannot see it); ``json.JSONDecodeError`` when it is not JSON."""
    if json_nesting_exceeds(text.encode("utf-8")):
        raise UnusableJSON(f"nests JSON arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    value = json.loads(text)
    found = unpaired_surrogate(value)
    if found is not None:
        where, char, index = found
        raise UnusableJSON(f"has an unpaired UTF-16 surrogate ({char!a}) at character {index}{where or ' of a string'}")
    return value
