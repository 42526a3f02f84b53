"""``pagoda serve --request-log PATH``: one JSON line per finished request, and its conversion to a trace.

The log is written by an observer of ``pagoda_request_finished`` (it runs on the engine's thread,
after the request's blocks are freed, and only appends a line). Times in a line are the engine's
monotonic clock in seconds; ``ttft``, ``queue`` and ``e2e`` are measured from the request's arrival.
Each of the ``n`` sequences of a request is a line of its own, with the user request in ``parent_id``.
``tenant`` is who sent it, as the server identified it (``--tenant-source``; an API key only as its hash), so a
replay under the ``fair`` policy shares the engine between the same tenants.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

import pagoda
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.simulate.trace import MAX_TENANT_CHARS, TraceRequest


class RequestLogWriter:
    """A plugin object: appends each finished request to a JSON-lines file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: Optional[TextIO] = self.path.open("a", buffering=1)
        except OSError as exc:
            raise ConfigError(f"--request-log {path}: cannot open it for appending ({exc}); pass a writable path") \
                from None
        self._lock = threading.Lock()

    @pagoda.hookimpl
    def pagoda_request_finished(self, request) -> None:
        end = request.last_token_time or time.monotonic()

        def since_arrival(t: Optional[float]) -> Optional[float]:
            return None if t is None else round(t - request.arrival_time, 6)

        line = {
            "request_id": request.request_id,
            "parent_id": request.parent_id,
            "arrival_time": request.arrival_time,
            "priority": request.priority,
            "tenant": request.tenant,
            "prompt_token_ids": request.prompt_token_ids,
            "num_output_tokens": request.num_output_tokens,
            "max_tokens": request.sampling_params.max_tokens,
            "finish_reason": request.finish_reason,
            "queue": since_arrival(request.scheduled_time),
            "ttft": since_arrival(request.first_token_time),
            "e2e": since_arrival(end),
            "num_cached_tokens": request.num_cached_tokens,
            # the LoRA adapter's name (None: the base model)
            "lora_name": request.lora_request.lora_name if request.lora_request is not None else None,
        }
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def trace_from_request_log(path: str | Path) -> tuple[list[TraceRequest], int]:
    """The trace a request log describes (arrivals from the first one, output lengths as generated);
    returns it and the number of lines skipped (requests that ended before their first token)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"request log {path} does not exist; write one with `pagoda serve --request-log {path}`")
    rows, skipped = [], 0
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                arrival, ids, out = float(d["arrival_time"]), list(d["prompt_token_ids"]), int(d["num_output_tokens"])
                priority = int(d.get("priority") or 0)
                lora_name = d.get("lora_name")
                if lora_name is not None and not isinstance(lora_name, str):
                    raise TypeError(f"lora_name {lora_name!r} is not a name")
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{lineno}: not a `pagoda serve --request-log` line ({type(exc).__name__}: "
                                  f"{exc})") from None
            tenant = d.get("tenant")  # logs written before tenants were recorded have none: one shared tenant
            if tenant is not None and (not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS):
                raise ConfigError(f"{path}:{lineno}: tenant={tenant!r}; expected a name of 1 to {MAX_TENANT_CHARS} "
                                  "characters, or null for the shared tenant")
            if out < 1 or not ids:
                skipped += 1
                continue
            rows.append((arrival, TraceRequest(arrival, out, len(ids), priority, prompt_token_ids=ids, tenant=tenant,
                                               lora_name=lora_name or None)))
    if not rows:
        raise ConfigError(f"request log {path} holds no request that produced a token")
    rows.sort(key=lambda row: row[0])
    start = rows[0][0]
    for arrival, req in rows:
        req.arrival = arrival - start
    return [req for _, req in rows], skipped
