"""What a prefill instance is asked in disaggregated serving (``pagoda kv-proxy`` and ``--replica-roles``): the
request computes its prompt, saves the prompt's blocks through the KV connector and answers with one token; the
decode instance then gets the request unchanged and loads those blocks. No torch here: the proxy imports it."""

from __future__ import annotations

from typing import Any


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """A completion or chat request as a prefill instance gets it: one token, one choice, no streaming."""
    first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    first.update(max_tokens=1, stream=False, n=1)
    return first
