"""``pagoda bench timeline LOG [--step-log STEPS]``: where served requests' first tokens went.

Reads a ``pagoda serve --timeline-log`` file (one line per request: its points in milliseconds after uvicorn
handed it over) and prints, for each stretch between two consecutive points, its mean, median, p90 and
largest value over the requests. With the same run's ``--step-log``, each request is placed among the engine's
steps: the step that was running when it was handed in (and how much of it was left), and the step that first
scheduled it (its prefill tokens and decode rows, its length).
"""

from __future__ import annotations

import argparse
import bisect
import sys
from typing import Optional

from pagoda.plugins.entrypoints.bench.step_log import read_log

# (from point, to point, what the stretch is)
STRETCHES = [
    ("received", "parsed", "body read, parsed and validated"),
    ("parsed", "tokenized", "tokenizing"),
    ("tokenized", "handed_in", "checks, hand-in to the engine"),
    ("handed_in", "queued", "waiting for the running step"),
    ("queued", "scheduled", "queued until scheduled"),
    ("scheduled", "first_token", "the first step (its prefill)"),
    ("first_token", "delivered", "engine thread to event loop"),
    ("delivered", "first_output", "first output made (detokenized)"),
    ("first_output", "first_written", "first chunk's JSON and write"),
    ("received", "first_written", "server TTFT: arrival to first bytes"),
]


def stats(values: list[float]) -> dict[str, float]:
    """Mean, median, p90 and maximum (nearest rank) of ``values``; NaN when there are none."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "max": float("nan")}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}


def stretch_values(requests: list[dict], start: str, end: str) -> list[float]:
    values = []
    for r in requests:
        ms = dict(r["ms"], received=0.0)
        if start in ms and end in ms:
            values.append(ms[end] - ms[start])
    return values


class Steps:
    """A step log's steps in time order, found by the time they ran at."""

    def __init__(self, steps: list[dict]) -> None:
        self.steps = sorted((s for s in steps if "start" in s), key=lambda s: s["start"])
        self.starts = [s["start"] for s in self.steps]
        self.ends = [s["end"] for s in self.steps]

    def at(self, t: float) -> Optional[dict]:
        """The step running at ``t`` (engine clock, seconds), or None when none was."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t <= self.steps[i]["end"]:
            return self.steps[i]
        return None

    def ending_at_or_after(self, t: float) -> Optional[dict]:
        """The first step that ended at ``t`` or later (the step that committed a token at ``t``), or None."""
        i = bisect.bisect_left(self.ends, t)
        return self.steps[i] if i < len(self.steps) else None


def place_in_steps(requests: list[dict], steps: Steps) -> dict[str, list[float]]:
    """Per request: what was left of the step running when it was handed in (0: none ran), and the first step
    that scheduled it, its length, prefill tokens and rows and decode rows."""
    out: dict[str, list[float]] = {"left_of_running_step_ms": [], "running_step_ms": [], "first_step_ms": [],
                                   "first_step_prefill_tokens": [], "first_step_prefill_rows": [],
                                   "first_step_decode_rows": []}
    for r in requests:
        ms = r["ms"]
        if "handed_in" in ms:
            handed_in = r["received"] + ms["handed_in"] / 1e3
            running = steps.at(handed_in)
            out["left_of_running_step_ms"].append((running["end"] - handed_in) * 1e3 if running else 0.0)
            if running is not None:
                out["running_step_ms"].append(running["step_ms"])
        if "first_token" in ms:
            # the step that committed the first token: the step log's end is stamped after the engine's own
            first = steps.ending_at_or_after(r["received"] + ms["first_token"] / 1e3)
            if first is not None:
                out["first_step_ms"].append(first["step_ms"])
                out["first_step_prefill_tokens"].append(first["prefill_tokens"])
                out["first_step_prefill_rows"].append(first["prefill_rows"])
                out["first_step_decode_rows"].append(first["decode_rows"])
    return out


def format_report(path: str, requests: list[dict], steps: Optional[Steps]) -> str:
    lines = [f"==== {path}: {len(requests)} requests ====",
             f"{'(ms)':<40}{'mean':>9}{'p50':>9}{'p90':>9}{'max':>9}"]

    def row(label: str, values: list[float], fmt: str = "{:>9.1f}") -> None:
        s = stats(values)
        lines.append(f"{label:<40}" + "".join(fmt.format(s[k]) for k in ("mean", "p50", "p90", "max")))

    for start, end, label in STRETCHES:
        row(label, stretch_values(requests, start, end))
    if steps is not None:
        placed = place_in_steps(requests, steps)
        busy = sum(1 for v in placed["left_of_running_step_ms"] if v > 0)
        lines.append(f"-- among the engine's steps ({busy} of {len(placed['left_of_running_step_ms'])} requests "
                     "arrived while a step ran)")
        row("left of the step running at hand-in", placed["left_of_running_step_ms"])
        row("  that step's whole length", placed["running_step_ms"])
        row("first step's length", placed["first_step_ms"])
        row("  its prefill tokens", placed["first_step_prefill_tokens"], "{:>9.0f}")
        row("  its prefill rows (prompts)", placed["first_step_prefill_rows"], "{:>9.1f}")
        row("  its decode rows", placed["first_step_decode_rows"], "{:>9.1f}")
    return "\n".join(lines)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="summarise a timeline log (pagoda serve --timeline-log): where first tokens went")
    p.add_argument("log", help="the timeline log")
    p.add_argument("--step-log", default=None, metavar="PATH",
                   help="the same run's step log (pagoda serve --step-log): place each request among the steps")
    p.set_defaults(func=run_timeline)


def run_timeline(ns: argparse.Namespace) -> int:
    requests = read_log("timeline", ns.log, "requests")
    step_rows = read_log("timeline", ns.step_log, "steps") if ns.step_log else []
    if requests is None or step_rows is None:
        return 2
    steps = Steps(step_rows) if ns.step_log else None
    if steps is not None and not steps.steps:
        print(f"pagoda bench timeline: {ns.step_log} holds no steps with start and end times (written by a pagoda "
              "older than --timeline-log?)", file=sys.stderr)
        return 2
    print(format_report(ns.log, requests, steps))
    return 0
