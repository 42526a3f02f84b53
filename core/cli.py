"""The ``pagoda`` command: sub-commands come from plugins through ``pagoda_cli_commands``."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from typing import Any, Optional, Sequence

from pagoda.config import EngineArgs
from pagoda.errors import PagodaError
from pagoda.plugin_manager import get_plugin_manager

# flags whose values are JSON objects on the command line
_JSON_FLAGS = {"speculative_config"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag-name`` per EngineArgs field (vLLM's spelling), defaulting to "not given"."""
    group = parser.add_argument_group("engine options")
    for name, field in EngineArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        args = typing.get_args(annotation)
        base = next((a for a in args if a is not type(None)), annotation) if args else annotation
        help_text = field.description or f"(default: {field.default})"
        if base is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name in _JSON_FLAGS:
            group.add_argument(flag, dest=name, type=json.loads, default=None, help="JSON object")
        elif base in (int, float):
            group.add_argument(flag, dest=name, type=base, default=None, help=help_text)
        else:
            choices = typing.get_args(base) if typing.get_origin(base) is typing.Literal else None
            group.add_argument(flag, dest=name, default=None, choices=choices, help=help_text)
    group.add_argument("--kv-cache-space", dest="kv_cache_space", type=float, default=None,
                       help="GiB of memory for the KV cache on a CPU (sets --kv-cache-memory-bytes)")


def engine_args_from(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from parsed flags: only the flags actually given, plus overrides."""
    values = {name: getattr(ns, name) for name in EngineArgs.model_fields if getattr(ns, name, None) is not None}
    if getattr(ns, "kv_cache_space", None) is not None:
        values["kv_cache_memory_bytes"] = int(ns.kv_cache_space * (1 << 30))
    values.update(overrides)
    return EngineArgs.build(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: LLM inference and serving")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    pm = get_plugin_manager()
    for component in pm.table():
        if component.kind == "CLI command":
            component.factory(sub)
    parser.set_defaults(plugin_manager=pm)
    return parser


def _version() -> str:
    from pagoda import __version__

    return f"pagoda {__version__}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # answer without loading every plugin
        print(_version())
        return 0
    parser = build_parser()
    ns = parser.parse_args(args)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    try:
        return int(ns.func(ns) or 0)
    except PagodaError as exc:
        print(f"pagoda {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
