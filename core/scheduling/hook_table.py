"""The scheduling policy hooks as docs/plugins.md lists them, read from their docstrings in
:mod:`pagoda.scheduling.scheduler` (tests/test_scheduling_policy.py checks the page holds exactly
:func:`hooks_markdown`)."""

from __future__ import annotations

import inspect

from pagoda.scheduling.scheduler import HOOKS, SchedulingPolicy

def _docstring(name: str) -> str:
    return " ".join(getattr(SchedulingPolicy, name).__doc__.split())


def hook_default(name: str) -> str:
    """The documented default of hook ``name``: its docstring after ``Default:``."""
    return _docstring(name).rpartition("Default: ")[2]


def hook_when(name: str) -> str:
    """When hook ``name`` is called and what it answers: its docstring from ``When:`` to ``Default:``."""
    return _docstring(name).partition("When: ")[2].partition(" Default: ")[0]


def hooks_markdown() -> str:
    """The table of docs/plugins.md listing every hook, when it is called and its default, from the docstrings
    above (tests/test_scheduling_policy.py checks the page holds exactly this)."""
    rows = ["| hook | when it is called, and what it answers | default (`fcfs`) |", "|---|---|---|"]
    for name in HOOKS:
        params = list(inspect.signature(getattr(SchedulingPolicy, name)).parameters)[1:]
        rows.append(f"| `{name}({', '.join(params)})` | {hook_when(name)} | {hook_default(name)} |")
    return "\n".join(rows).replace("``", "`") + "\n"
