"""The ``pagoda`` command: sub-commands come from plugins through ``pagoda_cli_commands``.

Only light modules are imported here: ``main`` chooses the OpenMP wait policy
before anything loads torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pagoda.errors import PagodaError
from pagoda.host.env import HOST_VARIABLES

if TYPE_CHECKING:
    from pagoda.engine.engine_args import EngineArgs

# flags whose values are JSON objects on the command line
_JSON_FLAGS = {"speculative_config", "scheduler_options", "kv_connector_options", "override_generation_config"}
# flags that take one or more values
_LIST_FLAGS = {"lora_modules"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag-name`` per EngineArgs field (vLLM's spelling), defaulting to "not given"."""
    from pagoda.engine.engine_args import EngineArgs

    engine_group = parser.add_argument_group("engine options")
    host_group = parser.add_argument_group(
        "host options", "how the engine uses this machine; each defaults to the environment variable named")
    for name, field in EngineArgs.model_fields.items():
        group = host_group if name in HOST_VARIABLES else engine_group
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        args = typing.get_args(annotation)
        base = next((a for a in args if a is not type(None)), annotation) if args else annotation
        help_text = field.description or f"(default: {field.default})"
        if base is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name in _LIST_FLAGS:
            group.add_argument(flag, dest=name, nargs="+", default=None, help=help_text)
        elif name in _JSON_FLAGS:
            group.add_argument(flag, dest=name, type=json.loads, default=None, help=field.description or "JSON object")
        elif base in (int, float):
            group.add_argument(flag, dest=name, type=base, default=None, help=help_text)
        else:
            choices = typing.get_args(base) if typing.get_origin(base) is typing.Literal else None
            group.add_argument(flag, dest=name, default=None, choices=choices, help=help_text)
    engine_group.add_argument("--kv-cache-space", dest="kv_cache_space", type=float, default=None,
                              help="GiB of memory for the KV cache on a CPU (sets --kv-cache-memory-bytes)")


def engine_args_from(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from parsed flags: only the flags actually given, plus overrides."""
    from pagoda.engine.engine_args import EngineArgs

    values = {name: getattr(ns, name) for name in EngineArgs.model_fields if getattr(ns, name, None) is not None}
    if getattr(ns, "kv_cache_space", None) is not None:
        values["kv_cache_memory_bytes"] = int(ns.kv_cache_space * (1 << 30))
    values.update(overrides)
    return EngineArgs.build(**values)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagoda`` parser with every plugin's sub-command. No plugin problem stops it: a command that pagoda
    and a plugin both provide stays pagoda's, the plugin's is added under its qualified name
    (``mypkg:generate``); a command two plugins provide answers with the conflict, each of them being reachable
    by its qualified name; one whose ``register`` raises is recorded as its plugin's failure (``pagoda plugins``
    shows them all)."""
    from pagoda.registry.plugin_manager import get_plugin_manager

    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: LLM inference and serving",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    pm = get_plugin_manager()
    for component in pm.table():
        if component.kind == "CLI command":
            _register_command(pm, sub, component)
    for conflict in pm.conflict_list():
        if conflict.kind != "CLI command":
            continue
        if conflict.chosen is None:
            command = sub.add_parser(conflict.name, help=f"(unavailable: {conflict.reason})", add_help=False)
            command.add_argument("rest", nargs=argparse.REMAINDER)
            command.set_defaults(func=_refuse(conflict.reason))
        for other in conflict.others:
            _register_command(pm, _QualifiedSubparsers(sub, other.name, other.qualified_name), other)
    if pm.failures:  # listed in --help, as in `pagoda plugins`
        parser.epilog = "plugins that failed to load (`pagoda plugins` prints why):\n" + "\n".join(
            f"  (failed) {f.name} from {f.dist}: {f.reason}" for f in pm.failures)
    parser.set_defaults(plugin_manager=pm)
    return parser


class _QualifiedSubparsers:
    """The sub-parsers a clashing command's ``register`` is given: the command it adds under its plain name is
    added under its qualified name; everything else goes to ``sub`` unchanged."""

    def __init__(self, sub: Any, name: str, qualified_name: str) -> None:
        self.sub, self.name, self.qualified_name = sub, name, qualified_name

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if name == self.name:
            name = self.qualified_name
            kwargs.pop("aliases", None)
        return self.sub.add_parser(name, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.sub, attr)


def _register_command(pm: Any, sub: Any, component: Any) -> None:
    """``component.factory(sub)``; a command whose registration raises is left out, as its plugin's failure."""
    import traceback

    from pagoda.registry.plugin_manager import PluginFailure

    try:
        component.factory(sub)
    except Exception:
        pm.failures.append(PluginFailure(component.plugin, component.dist, traceback.format_exc()))


def _refuse(reason: str):
    def run(ns: argparse.Namespace) -> int:
        raise PagodaError(reason)

    return run


def _version() -> str:
    from pagoda import __version__

    return f"pagoda {__version__}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:  # answer without loading every plugin
        print(_version())
        return 0
    try:
        _choose_openmp_wait_policy(args)
    except PagodaError as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2
    try:
        parser = build_parser()
    except PagodaError as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2
    pm = parser.get_default("plugin_manager")
    if args[:1] != ["plugins"]:  # which prints them in its own listing
        for conflict in pm.conflict_list():
            print(f"pagoda: note: {conflict.reason}", file=sys.stderr)
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


def _choose_openmp_wait_policy(args: list[str]) -> None:
    """OpenMP reads its wait policy when torch loads it, so ``--omp-wait-policy`` (else its environment
    variable) is applied before the plugins, and torch with them, are imported."""
    from pagoda.host.openmp import WAIT_POLICIES
    from pagoda.host.settings import set_openmp_wait_policy

    early = argparse.ArgumentParser(prog="pagoda", add_help=False, allow_abbrev=False)
    early.add_argument("--omp-wait-policy", default=None)
    known, _ = early.parse_known_args(args)
    if known.omp_wait_policy is None or known.omp_wait_policy in WAIT_POLICIES:
        set_openmp_wait_policy(known.omp_wait_policy)
    # else the command's own parser refuses the value, naming the choices


if __name__ == "__main__":
    sys.exit(main())
