"""One Prometheus page for the whole replica set: each replica's samples with a ``replica`` label."""

from __future__ import annotations

import re

# a sample line: metric name, optional {labels}, the rest (value and optional timestamp)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s+.*)$")


def merge_replica_metrics(pages: dict[str, str]) -> str:
    """``pages`` maps replica name to its /metrics text; each family is written once, with every
    replica's samples under it (the text format wants a family's lines together)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in pages.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if family not in samples:
                    headers.setdefault(family, []).append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, rest = match.groups()
            inner = f'replica="{replica}"' + ("," + labels[1:-1] if labels and labels != "{}" else "")
            samples.setdefault(family or name, []).append(f"{name}{{{inner}}}{rest}")
        for family in headers:
            samples.setdefault(family, [])
    lines: list[str] = []
    for family, rows in samples.items():
        lines += headers.get(family, []) + rows
    return "\n".join(lines) + "\n"
