"""The plugin manager: loads the ``pagoda.plugins`` entry points (pagoda's own first), checks each plugin's
declared API range, resolves component names."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, overload

import pluggy

from pagoda import PLUGIN_API_VERSION, __version__, hookspecs
from pagoda.errors import ConfigError
from pagoda.host.env import env_bool

if TYPE_CHECKING:
    from pagoda.interfaces import (AllReduceFactory, AttentionBackendFactory, CLICommand, ExecutorFactory,
                                   KVAllocatorFactory, KVConnectorFactory, LoRABackendFactory, ModelArchitectureFactory,
                                   ModelLoaderFactory, ProposerFactory, QuantMethodFactory, ReasoningParserFactory,
                                   RouterFactory, SamplerFactory, SchedulerFactory, StructuredOutputBackendFactory,
                                   ToolParserFactory)

logger = logging.getLogger("pagoda")

ENTRY_POINT_GROUP = "pagoda.plugins"
BUILTIN_DIST = "pagoda (built-in)"
# the distribution whose entry points are the built-in plugins (pyproject.toml declares them like any package)
PAGODA_DIST = "pagoda"
# the module attribute by which a plugin declares the plugin API versions it supports, e.g. ">=0.10,<0.11"
API_ATTRIBUTE = "PAGODA_PLUGIN_API"

# hook name -> human name of the component kind, used in messages and tables
COMPONENT_HOOKS: dict[str, str] = {
    "pagoda_model_loaders": "model loader",
    "pagoda_model_architectures": "model architecture",
    "pagoda_kv_allocators": "KV allocator",
    "pagoda_kv_connectors": "KV connector",
    "pagoda_schedulers": "scheduler",
    "pagoda_attention_backends": "attention backend",
    "pagoda_samplers": "sampler",
    "pagoda_structured_output_backends": "structured-output backend",
    "pagoda_lora_backends": "LoRA backend",
    "pagoda_quant_methods": "quantization method",
    "pagoda_proposers": "speculative proposer",
    "pagoda_executors": "executor",
    "pagoda_all_reduce_backends": "all-reduce backend",
    "pagoda_routers": "request router",
    "pagoda_tool_parsers": "tool-call parser",
    "pagoda_reasoning_parsers": "reasoning parser",
    "pagoda_cli_commands": "CLI command",
}

# component kinds whose built-ins a third-party component of the same name replaces instead of clashing with
# (vLLM's ModelRegistry.register_model): config.json names the architecture, so a plugin with a better
# Qwen3ForCausalLM must take that name; two third-party providers of one name still clash
BUILTIN_OVERRIDE_HOOKS = ("pagoda_model_architectures",)


@dataclass(frozen=True)
class Component:
    """One named component and where it comes from."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    dist: str
    # the distribution's project name (``pagoda`` for the built-ins): the prefix of the qualified name
    dist_name: str = ""

    @property
    def qualified_name(self) -> str:
        """``<distribution>:<name>`` (``pagoda:fcfs``, ``mypkg:fcfs``): selects this component whoever else
        provides ``name``."""
        return f"{self.dist_name or self.plugin}:{self.name}"


@dataclass
class PluginFailure:
    """A plugin that could not be imported or registered: ``error`` in full (a traceback, or the API
    mismatch), ``reason`` in one line."""

    name: str
    dist: str
    error: str

    @property
    def reason(self) -> str:
        lines = [line for line in self.error.strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else "unknown error"


@dataclass(frozen=True)
class Conflict:
    """Two or more plugins providing one component name. When one of them is pagoda's own (``chosen``), the plain
    name keeps selecting it and the others are selected by their qualified names; otherwise the plain name selects
    none of them, and each is selected by its qualified name."""

    kind: str
    name: str
    providers: tuple[Component, ...]
    chosen: Optional[Component] = None

    @property
    def others(self) -> tuple[Component, ...]:
        return tuple(c for c in self.providers if c is not self.chosen)

    @property
    def reason(self) -> str:
        """One line: who provides the name, what the plain name selects, and how to choose."""
        who = " and ".join(f"plugin {c.plugin!r} from {c.dist}" for c in self.providers)
        count = "two" if len(self.providers) == 2 else str(len(self.providers))
        qualified = " or ".join(repr(c.qualified_name) for c in self.others)
        if self.chosen is not None:
            return (f"{count} plugins provide the {self.kind} {self.name!r}: {who}; {self.name!r} selects pagoda's "
                    f"own, select the other by its qualified name {qualified}")
        # the one to block: the last loaded
        return (f"{count} plugins provide the {self.kind} {self.name!r}: {who}; select one by its qualified name "
                f"{qualified}, uninstall one, or block one with PAGODA_DISABLE_PLUGINS={self.providers[-1].plugin}")


@dataclass
class PluginManager:
    """pluggy's manager plus pagoda's name registry.

    Every process builds its own. ``components`` is filled once, in
    :meth:`load`; after that, lookups are plain dictionary reads.
    """

    pm: pluggy.PluginManager = field(default_factory=lambda: pluggy.PluginManager("pagoda"))
    dists: dict[str, str] = field(default_factory=dict)
    # plugin name -> its distribution's project name (the prefix of its components' qualified names)
    dist_names: dict[str, str] = field(default_factory=dict)
    # plugin name -> the API range it declared (PAGODA_PLUGIN_API), where it declared one
    api_ranges: dict[str, str] = field(default_factory=dict)
    # plugin name -> distribution, for installed plugins not loaded because PAGODA_DISABLE_PLUGINS names them
    blocked: dict[str, str] = field(default_factory=dict)
    # names in PAGODA_DISABLE_PLUGINS that are no installed plugin's name
    unmatched_blocks: list[str] = field(default_factory=list)
    failures: list[PluginFailure] = field(default_factory=list)
    components: dict[str, dict[str, Component]] = field(default_factory=dict)
    # hook name -> component name -> the plugins that all provide it (the plain name selects pagoda's own among
    # them, or none)
    conflicts: dict[str, dict[str, Conflict]] = field(default_factory=dict)
    # hook name -> component name -> every provider, for qualified names (``dist:name``)
    providers: dict[str, dict[str, list[Component]]] = field(default_factory=dict)
    # (hook name, component name) of the conflicts a selection warned about already
    noted_conflicts: set[tuple[str, str]] = field(default_factory=set)
    # hook name -> component name -> the built-in a third-party component replaces (BUILTIN_OVERRIDE_HOOKS)
    overridden: dict[str, dict[str, Component]] = field(default_factory=dict)
    # True while the component hooks are being called (the registry is incomplete)
    is_collecting: bool = False

    @property
    def hook(self):
        return self.pm.hook

    def load(self, autoload: bool | None = None, disabled: set[str] | None = None) -> "PluginManager":
        """Load the ``pagoda.plugins`` entry points, pagoda's own first (``autoload`` False: only those),
        then build the name registry.

        Built-ins come in the way a third-party plugin does. An entry point whose name is taken already
        (by a plugin loaded, blocked or failed before it) is named ``<distribution>:<name>``, never dropped,
        and that is the name ``disabled`` (``PAGODA_DISABLE_PLUGINS``) blocks it by.
        """
        self.pm.add_hookspecs(hookspecs)
        if disabled is None:
            disabled = _disabled_from_env()
        if autoload is None:
            autoload = env_bool("PAGODA_PLUGIN_AUTOLOAD", True)
        for name in disabled:
            self.pm.set_blocked(name)
        own, others = _entry_points()
        if not own:
            raise ConfigError(
                f"pagoda's own plugins are not installed: no {ENTRY_POINT_GROUP!r} entry points of the "
                f"{PAGODA_DIST!r} distribution were found; install pagoda (`make install`, or "
                "`pip install -e .` in its source folder) instead of running it from the folder"
            )
        taken: set[str] = set()
        for ep in own + (others if autoload else []):
            dist_name = ep.dist.name if ep.dist else "unknown"
            dist = BUILTIN_DIST if ep in own else f"{dist_name} {ep.dist.version if ep.dist else ''}".strip()
            name = f"{dist_name}:{ep.name}" if ep.name in taken else ep.name
            taken.add(name)
            if name in disabled:
                self.blocked[name] = dist
                continue
            self._register(name, dist, ep.load, dist_name)
        self.unmatched_blocks = sorted(disabled - set(self.blocked))
        self._build_registry()
        return self

    def register(self, plugin: Any, name: str, dist: str = "local") -> None:
        """Register a plugin object at run time (tests, embedding apps) and
        rebuild the registry."""
        self.pm.register(plugin, name=name)
        self.dists[name] = dist
        self.dist_names[name] = dist.split()[0] if dist.strip() else name
        self._build_registry()

    def _register(self, name: str, dist: str, load: Callable[[], Any], dist_name: str) -> None:
        try:
            plugin = load()
        except Exception:
            self.failures.append(PluginFailure(name, dist, traceback.format_exc()))
            return
        declared = getattr(plugin, API_ATTRIBUTE, None)
        if declared is not None:
            problem = api_mismatch(str(declared))
            if problem is not None:
                self.failures.append(PluginFailure(
                    name, dist, f"plugin {name!r} from {dist} supports the pagoda plugin API {declared} but "
                                f"pagoda {__version__} has plugin API {PLUGIN_API_VERSION} ({problem}; before 1.0 each "
                                f"minor version of the plugin API may break plugins); install a release of "
                                f"{dist.split()[0]} made for API {PLUGIN_API_VERSION}, or block it with "
                                f"PAGODA_DISABLE_PLUGINS={name}"))
                return
            self.api_ranges[name] = str(declared)
        try:
            self.pm.register(plugin, name=name)
        except Exception:
            self.failures.append(PluginFailure(name, dist, traceback.format_exc()))
            return
        self.dists[name] = dist
        self.dist_names[name] = dist_name

    def _build_registry(self) -> None:
        components: dict[str, dict[str, Component]] = {}
        conflicts: dict[str, dict[str, Conflict]] = {}
        all_providers: dict[str, dict[str, list[Component]]] = {}
        overridden: dict[str, dict[str, Component]] = {}
        self.is_collecting = True
        try:
            for hook_name, kind in COMPONENT_HOOKS.items():
                providers: dict[str, list[Component]] = {}
                all_providers[hook_name] = providers
                for component in self._collect(hook_name, kind):
                    providers.setdefault(component.name, []).append(component)
                components[hook_name], conflicts[hook_name], overridden[hook_name] = {}, {}, {}
                for name, found in providers.items():
                    if len(found) == 1:
                        components[hook_name][name] = found[0]
                        continue
                    own = [c for c in found if c.dist == BUILTIN_DIST]
                    third_party = [c for c in found if c.dist != BUILTIN_DIST]
                    if hook_name in BUILTIN_OVERRIDE_HOOKS:
                        # a model architecture is the one kind a package overrides by its name alone: the package
                        # was installed to run that architecture its own way (the built-in stays as pagoda:name);
                        # two packages overriding one name select neither by the plain name
                        if len(own) == 1 and len(third_party) == 1:
                            components[hook_name][name] = third_party[0]
                            overridden[hook_name][name] = own[0]
                        else:
                            conflicts[hook_name][name] = Conflict(kind, name, tuple(found))
                        continue
                    # a name pagoda's own plugin provides keeps selecting it: installing a package never changes
                    # what an unchanged configuration selects
                    chosen = own[0] if len(own) == 1 else None
                    conflicts[hook_name][name] = Conflict(kind, name, tuple(found), chosen)
                    if chosen is not None:
                        components[hook_name][name] = chosen
        finally:
            self.is_collecting = False
        self.components, self.conflicts, self.providers = components, conflicts, all_providers
        self.overridden = overridden

    def _collect(self, hook_name: str, kind: str) -> list[Component]:
        """Every plugin's components of one hook; a hook that raises or returns something other than
        ``{name: factory}`` is recorded as its plugin's failure and contributes nothing."""
        found: list[Component] = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            plugin_name = self.pm.get_name(impl.plugin) or repr(impl.plugin)
            dist = self.dists.get(plugin_name, "unknown")
            # a hook may take the plugin manager, to look up the factories of the components it wraps
            kwargs = {"plugin_manager": self} if "plugin_manager" in impl.argnames else {}
            try:
                # hooks import their components lazily, so a missing dependency surfaces here
                mapping = impl.function(**kwargs) or {}
            except Exception:
                self._record_failure(plugin_name, dist, traceback.format_exc())
                continue
            if not isinstance(mapping, Mapping) or not all(isinstance(name, str) for name in mapping):
                self._record_failure(plugin_name, dist, f"{hook_name} of plugin {plugin_name!r} returned "
                                     f"{type(mapping).__name__} {mapping!r:.80}, not a {{name: factory}} mapping "
                                     "with string names; return a dict such as {'my-name': MyFactory}")
                continue
            dist_name = self.dist_names.get(plugin_name, plugin_name)
            found += [Component(kind, name, factory, plugin_name, dist, dist_name) for name, factory in mapping.items()]
        return found

    def _record_failure(self, name: str, dist: str, error: str) -> None:
        if not any(f.name == name and f.error == error for f in self.failures):  # the registry is rebuilt
            self.failures.append(PluginFailure(name, dist, error))

    def names(self, hook_name: str) -> list[str]:
        return sorted(self.components.get(hook_name, {}))

    def get(self, hook_name: str, name: str, option: str) -> Component:
        """The component called ``name``, or a ConfigError listing what exists (and, for a name two plugins
        provide, the one-line reason it cannot be selected).

        ``name`` is a component's name, or its qualified name ``<distribution>:<name>`` (``mypkg:fcfs``; the
        plugin's name works in place of the distribution's), which selects that provider whoever else provides
        the name. A plain name that pagoda's own plugin and others provide selects pagoda's own.
        """
        if hook_name not in COMPONENT_HOOKS:
            raise ConfigError(f"{hook_name!r} is not a component hook; use one of {', '.join(COMPONENT_HOOKS)}")
        available = self.components.get(hook_name, {})
        conflict = self.conflicts.get(hook_name, {}).get(name)
        if name in available:
            if conflict is not None and (hook_name, name) not in self.noted_conflicts:
                self.noted_conflicts.add((hook_name, name))
                logger.warning("%s %r: %s", option, name, conflict.reason)
            return available[name]
        if conflict is not None:
            raise ConfigError(f"cannot select {name!r} for {option}: {conflict.reason}")
        if ":" in name:
            return self._get_qualified(hook_name, name, option)
        kind = COMPONENT_HOOKS[hook_name]
        listing = ", ".join(f"{c.name!r} ({c.dist})" for c in sorted(available.values(), key=lambda c: c.name))
        msg = f"unknown {kind} {name!r} for {option}; available: {listing or 'none'}"
        shadowed = [c for found in self.conflicts.get(hook_name, {}).values() for c in found.others]
        if shadowed:
            msg += ", and by qualified name " + ", ".join(f"{c.qualified_name!r} ({c.dist})" for c in shadowed)
        if self.blocked:
            msg += ("; PAGODA_DISABLE_PLUGINS blocks the plugins " + ", ".join(
                f"{plugin} ({dist})" for plugin, dist in sorted(self.blocked.items()))
                + f", whose components are not loaded: if {name!r} is one of them, unblock its plugin")
        if self.failures:
            msg += "; plugins that failed to load: " + ", ".join(f"{f.name} ({f.dist}: {f.reason})"
                                                                  for f in self.failures)
            msg += " (run `pagoda plugins` for the details)"
        raise ConfigError(msg)

    def _get_qualified(self, hook_name: str, qualified: str, option: str) -> Component:
        """The provider of ``<distribution or plugin>:<name>``."""
        prefix, _, name = qualified.partition(":")
        found = self.providers.get(hook_name, {}).get(name, [])
        matches = [c for c in found if _normalize(prefix) in (_normalize(c.dist_name), _normalize(c.plugin))]
        if len(matches) == 1:
            return matches[0]
        kind = COMPONENT_HOOKS[hook_name]
        listing = ", ".join(f"{c.qualified_name!r} ({c.dist})" for c in found)
        if matches:
            raise ConfigError(f"cannot select {qualified!r} for {option}: {len(matches)} plugins of {prefix!r} "
                              f"provide the {kind} {name!r} ({', '.join(c.plugin for c in matches)}); block all "
                              "but one with PAGODA_DISABLE_PLUGINS")
        if found:
            raise ConfigError(f"no plugin of {prefix!r} provides the {kind} {name!r} for {option}; it is provided "
                              f"as {listing}")
        self.get(hook_name, name, option)  # the unknown plain name: the error lists what is available
        raise AssertionError("unreachable")  # pragma: no cover

    # overloads: the factory's type follows from the hook, as pagoda.interfaces declares it
    @overload
    def factory(self, hook_name: Literal["pagoda_model_loaders"], name: str) -> "ModelLoaderFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_model_architectures"], name: str) -> "ModelArchitectureFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_kv_allocators"], name: str) -> "KVAllocatorFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_kv_connectors"], name: str) -> "KVConnectorFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_schedulers"], name: str) -> "SchedulerFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_attention_backends"], name: str) -> "AttentionBackendFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_samplers"], name: str) -> "SamplerFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_structured_output_backends"], name: str
                ) -> "StructuredOutputBackendFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_lora_backends"], name: str) -> "LoRABackendFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_quant_methods"], name: str) -> "QuantMethodFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_proposers"], name: str) -> "ProposerFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_executors"], name: str) -> "ExecutorFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_all_reduce_backends"], name: str) -> "AllReduceFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_routers"], name: str) -> "RouterFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_tool_parsers"], name: str) -> "ToolParserFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_reasoning_parsers"], name: str) -> "ReasoningParserFactory": ...
    @overload
    def factory(self, hook_name: Literal["pagoda_cli_commands"], name: str) -> "CLICommand": ...

    def factory(self, hook_name: str, name: str) -> Any:
        """The factory of the component ``name`` of ``hook_name`` (``"pagoda_attention_backends"``,
        ``"torch"``), for a component that wraps or decorates another one.

        A component hook that takes a ``plugin_manager`` argument gets this manager; call ``factory``
        inside your own factory (when the engine builds its components, every plugin is loaded), not in
        the hook itself, which runs while the components are still being collected.
        """
        if self.is_collecting:
            raise ConfigError(f"plugin_manager.factory({hook_name!r}, {name!r}) was called while the plugins' "
                              "components are still being collected; call it inside your factory, which the "
                              "engine calls once every plugin is loaded")
        return self.get(hook_name, name, f"plugin_manager.factory({hook_name!r}, {name!r})").factory

    def table(self) -> list[Component]:
        """Every component its plain name selects, sorted by kind then name (for ``pagoda plugins``)."""
        rows = [c for by_name in self.components.values() for c in by_name.values()]
        return sorted(rows, key=lambda c: (c.kind, c.name))

    def override_list(self) -> list[tuple[Component, Component]]:
        """``(third-party component used, built-in it replaces)`` for every overridden built-in, by kind and
        name."""
        pairs = [(self.components[hook][name], builtin) for hook, by_name in self.overridden.items()
                 for name, builtin in by_name.items()]
        return sorted(pairs, key=lambda pair: (pair[0].kind, pair[0].name))

    def conflict_list(self) -> list[Conflict]:
        """Every name more than one plugin provides, sorted by kind then name."""
        return sorted((c for by_name in self.conflicts.values() for c in by_name.values()),
                      key=lambda c: (c.kind, c.name))

    def notify_request_finished(self, request: Any) -> None:
        self.pm.hook.pagoda_request_finished(request=request)


def api_mismatch(declared: str) -> str | None:
    """None if ``declared`` (a version specifier such as ``">=0.10,<0.11"``) admits this pagoda's plugin API
    version, else what is wrong with it."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        spec = SpecifierSet(declared)
    except InvalidSpecifier:
        return f"{declared!r} is not a version range such as '>=0.10,<0.11'"
    return None if spec.contains(PLUGIN_API_VERSION) else f"{PLUGIN_API_VERSION} is outside {declared!r}"


def _entry_points() -> tuple[list, list]:
    """pagoda's own ``pagoda.plugins`` entry points and everyone else's, each once."""
    own, others, seen = [], [], set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist_name = ep.dist.name if ep.dist else None
        key = (dist_name, ep.name, ep.value)
        if key in seen:  # one distribution found twice on sys.path
            continue
        seen.add(key)
        (own if dist_name == PAGODA_DIST else others).append(ep)
    # a fixed order, whatever order the file system lists the distributions in: which of two clashing
    # entry-point names becomes <distribution>:<name>, and the order in which messages name plugins
    others.sort(key=lambda ep: (ep.dist.name if ep.dist else "", ep.name))
    return own, others


def _normalize(name: str) -> str:
    """A distribution's name as the packaging tools compare it: case, ``_`` and ``.`` do not matter."""
    return name.lower().replace("_", "-").replace(".", "-")


def _disabled_from_env() -> set[str]:
    raw = os.environ.get("PAGODA_DISABLE_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> PluginManager:
    """A fresh, loaded plugin manager for this process."""
    return PluginManager().load()
