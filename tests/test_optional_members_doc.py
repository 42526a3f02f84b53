"""docs/plugins.md's table of optional protocol members agrees with what pagoda sets on a component lacking one
(pagoda.registry.adapt): every member pagoda fills in has a row, and the row's default is the value it sets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagoda.registry.adapt import OPTIONAL_MEMBERS, OPTIONAL_OFFLOAD_MEMBERS
from pagoda.step import KVTierMoves

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
PROTOCOL_OF_HOOK = {"pagoda_attention_backends": "AttentionBackend", "pagoda_kv_allocators": "KVCacheManager",
                    "pagoda_samplers": "Sampler", "pagoda_model_architectures": "CausalLM"}
# how the docs write a default value, as the leading words of its cell
LITERALS = {"None": None, "False": False, "True": True, "`{}`": {}, "`frozenset()`": frozenset(), "`set()`": set()}
# the arguments a default that is a method is called with to read what it answers
CALL_ARGS = {"is_swapped": ("request-0",), "isa_paths": (), "spill_to_disk": (), "layer_windows": ()}


def documented_rows() -> dict[tuple[str, str], str]:
    """(protocol, member) -> the default cell, from the table under "| protocol | optional member | default |"."""
    text = GUIDE.read_text()
    table = re.search(r"^\| protocol \| optional member \| default \|\n\|[-|]+\|\n((?:\|.*\n)+)", text, re.M)
    assert table, "docs/plugins.md lost its table of optional members"
    rows = {}
    for line in table.group(1).splitlines():
        protocol, member, default = (cell.strip() for cell in line.strip("|").split("|", 2))
        protocol = re.match(r"`(\w+)`", protocol).group(1)
        for name in re.findall(r"`(\w+)", member):
            rows[(protocol, name)] = default
    return rows


def code_members() -> list[tuple[str, str, object]]:
    members = [(PROTOCOL_OF_HOOK[hook], member, default)
               for hook, table in OPTIONAL_MEMBERS.items() for member, default in table.items()]
    return members + [("KVOffloadTiers", member, default) for member, default in OPTIONAL_OFFLOAD_MEMBERS.items()]


@pytest.mark.parametrize("protocol,member,default", code_members(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_optional_member_pagoda_sets_is_documented_with_its_default(protocol, member, default):
    rows = documented_rows()
    assert (protocol, member) in rows, (f"pagoda.registry.adapt sets {protocol}.{member} on a component lacking "
                                        "it, but docs/plugins.md's table of optional members has no row for it")
    cell = rows[(protocol, member)]
    value = default(object(), "chosen-name")
    if callable(value):
        value = value(*CALL_ARGS[member])
    if value == "chosen-name":
        assert "the name it was selected by" in cell, cell
        return
    if member == "spill_to_disk":
        assert cell.startswith("no moves") and value == KVTierMoves(), (cell, value)
        return
    literal = next((lit for lit in LITERALS if cell.startswith(lit)), None)
    assert literal is not None, f"{protocol}.{member}: the documented default {cell!r} starts with no value"
    expected = LITERALS[literal]
    assert value == expected and type(value) is type(expected), (
        f"{protocol}.{member}: docs/plugins.md says the default is {literal}, pagoda sets {value!r}")


def test_the_table_documents_no_member_of_those_protocols_that_pagoda_does_not_default():
    """A row for a protocol pagoda fills in names a member it fills in, or says who reads it instead."""
    known = {(protocol, member) for protocol, member, _ in code_members()}
    for protocol, member in documented_rows():
        if protocol in PROTOCOL_OF_HOOK.values() and (protocol, member) not in known:
            assert "not set" in _member_cell(protocol, member), (
                f"docs/plugins.md documents a default for {protocol}.{member}, which pagoda.registry.adapt does "
                "not set")


def _member_cell(protocol: str, member: str) -> str:
    for line in GUIDE.read_text().splitlines():
        if line.startswith(f"| `{protocol}` |") and f"`{member}" in line:
            return line.split("|")[2]
    return ""
