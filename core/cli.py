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


class ConfigFileAction(argparse.Action):
    """``--config FILE``: a YAML file of the command's flags, read before the command line is parsed
    (:func:`expand_config_file`); its flags come before the command line's, so the command line wins."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)


def add_config_file_arg(parser: argparse.ArgumentParser) -> None:
    """Give a command vLLM's ``--config FILE``."""
    parser.add_argument("--config", action=ConfigFileAction, default=None, metavar="FILE",
                        help="a YAML file of this command's flags, one 'flag-name: value' a line (true for a switch, "
                             "a list for several values); flags on the command line win over it")


def expand_config_file(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with the command's ``--config FILE`` replaced by the file's flags, placed after the command and
    its positional arguments and before its other flags (so those win, argparse keeping a flag's last value).
    A ``model`` key is left out when the command line names the model positionally, as vLLM does."""
    if not args or "--config" not in args:
        return args
    command = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    sub = command.choices.get(args[0]) if command is not None else None
    if sub is None or not any(isinstance(a, ConfigFileAction) for a in sub._actions):
        return args
    if args.count("--config") > 1:
        raise PagodaError("--config is given twice; give one YAML file")
    at = args.index("--config")
    if at + 1 == len(args):
        raise PagodaError("--config needs the path of a YAML file")
    path = args[at + 1]
    num_positional = next((i for i, a in enumerate(args[1:at]) if a.startswith("-")), at - 1)
    flags = _config_file_flags(sub, path, skip={"model"} if num_positional else set())
    head = args[:1 + num_positional]
    return head + flags + args[len(head):at] + args[at + 2:]


def _config_file_flags(parser: argparse.ArgumentParser, path: str, skip: set[str]) -> list[str]:
    """The flags a YAML config file sets, as command-line words."""
    import yaml  # installed with transformers

    if not path.endswith((".yaml", ".yml")):
        raise PagodaError(f"--config {path}: give a YAML file (.yaml or .yml)")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise PagodaError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise PagodaError(f"--config {path} is not valid YAML: {exc}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise PagodaError(f"--config {path}: expected a mapping of flag names to values, got "
                          f"{type(config).__name__}")
    flags: list[str] = []
    for key, value in config.items():
        name = str(key).replace("_", "-")
        if name.replace("-", "_") in skip:
            continue
        flag = "--" + name
        action = parser._option_string_actions.get(flag)
        if action is None:
            raise PagodaError(f"--config {path}: {key!r} is not a flag of this command (`--help` lists them)")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif "--no-" + name in parser._option_string_actions:
                flags.append("--no-" + name)
        elif isinstance(value, list) and action.nargs not in (None, "?"):
            flags += [flag, *map(str, value)] if value else []
        elif isinstance(value, (dict, list)):  # a JSON flag (--speculative-config, --allowed-origins, ...)
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


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
    try:
        args = expand_config_file(parser, args)
    except PagodaError as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2
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
