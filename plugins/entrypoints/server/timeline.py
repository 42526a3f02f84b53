"""``pagoda serve --timeline-log PATH``: where each generation request's first token went, one JSON line each.

A pure ASGI middleware stamps a request when uvicorn hands it to the app and when its response's bytes are
written; the route stamps it once FastAPI has parsed and validated the body (``parsed``), once its prompts are
tokenized (``tokenized``) and once its first output is made (``first_output``); the engine's side comes with
that output (handed in, queued by the engine thread after the step it arrived in, first scheduled, first token
committed) and the event loop's take-in of it (``delivered``). Every time is on the engine's monotonic clock:
the line has ``received`` in seconds (to join with ``--step-log``'s ``start`` and ``end``) and each point in
milliseconds after it. For a request of several prompts, the engine's points are its first prompt's.
``pagoda bench timeline PATH`` summarises a log. Nothing of it runs without the option.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

from pagoda.errors import ConfigError

# where a request's timeline sits in its ASGI scope
TIMELINE_KEY = "pagoda.timeline"
# the points of a line, in the order a request passes them
POINTS = ("parsed", "tokenized", "handed_in", "queued", "scheduled", "first_token", "delivered", "first_output",
          "first_written", "done")


@dataclass
class RequestTimeline:
    """One HTTP request's points (monotonic seconds), filled as it passes them."""

    received: float
    points: dict[str, float] = field(default_factory=dict)
    request_id: Optional[str] = None
    num_prompt_tokens: int = 0
    stream: bool = False

    def mark(self, name: str) -> None:
        self.points.setdefault(name, time.monotonic())

    def record(self) -> dict[str, Any]:
        ms = {name: round((self.points[name] - self.received) * 1e3, 3) for name in POINTS if name in self.points}
        return {"request_id": self.request_id, "received": round(self.received, 6), "stream": self.stream,
                "prompt_tokens": self.num_prompt_tokens, "ms": ms}


def mark(request: Any, name: str) -> None:
    """Stamp ``name`` on the request's timeline (nothing without ``--timeline-log``)."""
    timeline = request.scope.get(TIMELINE_KEY)
    if timeline is not None:
        timeline.mark(name)


def note_started(request: Any, request_id: str, gen: Any, stream: bool) -> None:
    """The request's first outputs are made (``gen``: its started Generation): stamp them, with the engine's
    points of its first prompt."""
    timeline = request.scope.get(TIMELINE_KEY)
    if timeline is None:
        return
    timeline.mark("first_output")
    first = gen.first[0]
    timeline.request_id, timeline.num_prompt_tokens, timeline.stream = request_id, len(first.prompt_token_ids), stream
    metrics = first.metrics
    engine_points = {"handed_in": metrics.arrival_time, "queued": metrics.queued_time,
                     "scheduled": metrics.first_scheduled_time, "first_token": metrics.first_token_time,
                     "delivered": gen.gens[0].first_delivered_time} if metrics is not None else {}
    timeline.points.update({k: v for k, v in engine_points.items() if v is not None})


class TimelineMiddleware:
    """Stamps every POST on arrival and at its first and last bytes written; appends the line of each one whose
    route filled it in (a generation request that produced an output) to ``path``."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        try:
            self._file: TextIO = open(path, "a", buffering=1)  # a line at a time: readable while the server runs
        except OSError as exc:
            raise ConfigError(f"--timeline-log {path}: cannot open it for appending ({exc}); pass a writable path") \
                from None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        timeline = scope[TIMELINE_KEY] = RequestTimeline(time.monotonic())

        async def timed_send(message) -> None:
            await send(message)
            if message["type"] != "http.response.body":
                return
            if message.get("body"):
                timeline.mark("first_written")
            if not message.get("more_body", False):
                timeline.mark("done")
                if timeline.request_id is not None:
                    self._file.write(json.dumps(timeline.record(), separators=(",", ":")) + "\n")

        await self.app(scope, receive, timed_send)
