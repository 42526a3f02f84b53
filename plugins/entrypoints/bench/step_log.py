"""A served (or offline) engine's steps, one JSON line each, and ``pagoda bench steps``: where they went.

``pagoda serve --step-log PATH`` adds a step observer (:class:`StepLog`) that
appends, for every step that ran the model, what it held and what its time went
to: prefill rows and tokens, decode rows and their context lengths, the
requests running and waiting, the engine's phases (schedule, execute, update,
emit), the runner's (attention metadata, model, LM head, sampling), the
attention layers' own time (K/V write and kernel, timed by forward hooks), and
the gap since the previous step ended (the engine thread's time outside steps:
adding requests, handing outputs to the event loop, waiting for the GIL or for
work), and when the step started and ended on the engine's monotonic clock
(``start``, ``end``, seconds). Nothing of it runs unless asked for.

``pagoda bench steps LOG [LOG ...]`` summarises each log: the steps with and
without prefill, each phase's mean, and the same weighted by decode rows, which
is what a streamed token's TPOT sees (a token waits for every step its request
sits in, so a long step shared by many decoding requests weighs in many times).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, TextIO

# the JSON keys of one step, in milliseconds, in the order the summary prints them
PHASES = [
    ("attention_ms", "attention (K/V write + kernel)"),
    ("model_other_ms", "rest of the model (matmuls, norms, ...)"),
    ("logits_ms", "LM head"),
    ("sampling_ms", "sampling"),
    ("metadata_ms", "attention metadata"),
    ("schedule_ms", "scheduling"),
    ("update_ms", "update (commit, stops)"),
    ("emit_ms", "outputs (new tokens per request)"),
    ("step_other_ms", "rest of the step (engine Python)"),
    ("gap_ms", "gap before the step (loop, commands, GIL)"),
]


class StepLog:
    """A step observer (``LLMEngine.observers``) appending one JSON line per step that ran the model to ``path``.
    ``close()`` removes its hooks and closes the file."""

    def __init__(self, engine, path: str) -> None:
        from pagoda.modeling.layers.attention import Attention
        from pagoda.plugins.entrypoints.bench.profile import _ModuleTimer

        self._file: TextIO = open(path, "a", buffering=1)  # a line at a time: readable while the server runs
        self._attention = _ModuleTimer(engine.model, {Attention: "attention"})
        self._last_end: Optional[float] = None

    def before_step(self, engine, sched) -> None:
        pass

    def after_step(self, engine, sched, result, seconds: float) -> None:
        now = time.perf_counter()
        attention = self._attention.seconds.pop("attention", 0.0)
        start = now - seconds
        gap = start - self._last_end if self._last_end is not None else 0.0
        self._last_end = now
        if result is None or not sched.requests:
            return
        record = step_record(engine, sched, seconds, gap, attention)
        # the engine's clock (a served request's timeline, --timeline-log, is on it too): when the step ran
        end = time.monotonic()
        record.update(start=round(end - seconds, 6), end=round(end, 6))
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._attention.close()
        self._file.close()


def step_record(engine, sched, seconds: float, gap: float, attention: float) -> dict:
    """One step's line: its rows and tokens and where its ``seconds`` went (ms)."""
    prefill_rows = prefill_tokens = 0
    contexts = []
    for req, start, n in zip(sched.requests, sched.num_computed_before, sched.num_new_tokens):
        if start < len(req.prompt_token_ids):
            prefill_rows += 1
            prefill_tokens += n
        else:
            contexts.append(start + n)
    phases = engine.last_step_timings
    runner = engine.runner.timings
    ms = {
        "step_ms": seconds * 1e3,
        "gap_ms": gap * 1e3,
        "schedule_ms": phases.get("schedule", 0.0) * 1e3,
        "execute_ms": phases.get("execute", 0.0) * 1e3,
        "update_ms": phases.get("update", 0.0) * 1e3,
        "emit_ms": phases.get("emit", 0.0) * 1e3,
        "metadata_ms": runner.get("metadata", 0.0) * 1e3,
        "model_ms": runner.get("model", 0.0) * 1e3,
        "logits_ms": runner.get("logits", 0.0) * 1e3,
        "sampling_ms": runner.get("sampling", 0.0) * 1e3,
        "attention_ms": attention * 1e3,
    }
    ms["model_other_ms"] = ms["model_ms"] - ms["attention_ms"]
    ms["step_other_ms"] = ms["step_ms"] - sum(ms[k] for k in ("schedule_ms", "update_ms", "emit_ms", "metadata_ms",
                                                               "model_ms", "logits_ms", "sampling_ms"))
    return {
        "t": time.time(),
        "prefill_rows": prefill_rows,
        "prefill_tokens": prefill_tokens,
        "decode_rows": len(contexts),
        "decode_context_mean": sum(contexts) / len(contexts) if contexts else 0.0,
        "decode_context_max": max(contexts, default=0),
        "running": engine.scheduler.num_running,
        "waiting": engine.scheduler.num_waiting,
        "threads": engine.num_threads,
        **{k: round(v, 4) for k, v in ms.items()},
    }


def read_steps(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_log(command: str, path: str, what: str) -> Optional[list[dict]]:
    """The JSON lines of a log; None, after saying why on stderr as ``pagoda bench COMMAND``, when it cannot be
    read or holds none (``what``: what its lines are)."""
    try:
        rows = read_steps(path)
    except (OSError, ValueError) as exc:
        print(f"pagoda bench {command}: error: cannot read {path}: {exc}", file=sys.stderr)
        return None
    if not rows:
        print(f"pagoda bench {command}: {path} holds no {what}", file=sys.stderr)
        return None
    return rows


def summarize_steps(steps: list[dict]) -> dict:
    """Means over all steps, over those with and without prefill, and per decode token (weighted by decode rows)."""
    def mean(rows: list[dict], key: str, weight: Optional[str] = None) -> float:
        if weight is None:
            return sum(r[key] for r in rows) / len(rows) if rows else float("nan")
        total = sum(r[weight] for r in rows)
        return sum(r[key] * r[weight] for r in rows) / total if total else float("nan")

    groups = {"all": steps, "decode only": [s for s in steps if not s["prefill_rows"]],
              "with prefill": [s for s in steps if s["prefill_rows"]]}
    keys = ["step_ms", "gap_ms", "prefill_tokens", "decode_rows", "decode_context_mean"] + [k for k, _ in PHASES]
    out = {name: {"steps": len(rows), **{k: mean(rows, k) for k in keys}} for name, rows in groups.items()}
    out["per decode token"] = {"steps": len(steps), **{k: mean(steps, k, "decode_rows") for k in keys}}
    return out


def format_summary(path: str, summary: dict) -> str:
    cols = list(summary)
    lines = [f"==== {path} ====", f"{'(means)':<44}" + "".join(f"{c:>18}" for c in cols)]

    def row(label: str, key: str, fmt: str = "{:>18.2f}") -> None:
        lines.append(f"{label:<44}" + "".join(fmt.format(summary[c][key]) for c in cols))

    row("steps", "steps", "{:>18d}")
    row("prefill tokens per step", "prefill_tokens", "{:>18.1f}")
    row("decode rows per step", "decode_rows", "{:>18.1f}")
    row("decode rows' mean context (tokens)", "decode_context_mean", "{:>18.1f}")
    row("step (ms)", "step_ms")
    for key, label in PHASES:
        row(f"  {label}", key)
    lines.append(f"{'attention share of the step':<44}" + "".join(
        f"{summary[c]['attention_ms'] / summary[c]['step_ms']:>18.1%}" if summary[c]["steps"] else f"{'':>18}"
        for c in cols))
    return "\n".join(lines)


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="summarise step logs (pagoda serve --step-log): where each step's time went")
    p.add_argument("logs", nargs="+", help="step log files, one summary each")
    p.set_defaults(func=run_steps)


def run_steps(ns: argparse.Namespace) -> int:
    for path in ns.logs:
        steps = read_log("steps", path, "steps")
        if steps is None:
            return 2
        print(format_summary(path, summarize_steps(steps)))
    return 0
