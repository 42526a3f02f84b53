"""The plugin manager: loads the ``pagoda.plugins`` entry points (pagoda's own first), checks each plugin's
declared API range, resolves component names."""

from __future__ import annotations

import importlib.metadata
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from pagoda import hookspecs
from pagoda.errors import ConfigError
from pagoda.host.env import env_bool
from pagoda.registry.deprecation import RenamingPluggy
from pagoda.version import PLUGIN_API_VERSION, __version__

ENTRY_POINT_GROUP = "pagoda.plugins"
BUILTIN_DIST = "pagoda (built-in)"
# the distribution whose entry points are the built-in plugins (pyproject.toml declares them like any package)
PAGODA_DIST = "pagoda"
# the module attribute by which a plugin declares the plugin API versions it supports, e.g. ">=1.0,<2"
API_ATTRIBUTE = "PAGODA_PLUGIN_API"

# hook name -> human name of the component kind, used in messages and tables
COMPONENT_HOOKS: dict[str, str] = {
    "pagoda_model_loaders": "model loader",
    "pagoda_model_architectures": "model architecture",
    "pagoda_kv_allocators": "KV allocator",
    "pagoda_schedulers": "scheduler",
    "pagoda_attention_backends": "attention backend",
    "pagoda_samplers": "sampler",
    "pagoda_quant_methods": "quantization method",
    "pagoda_proposers": "speculative proposer",
    "pagoda_executors": "executor",
    "pagoda_all_reduce_backends": "all-reduce backend",
    "pagoda_routers": "request router",
    "pagoda_cli_commands": "CLI command",
}


@dataclass(frozen=True)
class Component:
    """One named component and where it comes from."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    dist: str


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


@dataclass
class PluginManager:
    """pluggy's manager plus pagoda's name registry.

    Every process builds its own. ``components`` is filled once, in
    :meth:`load`; after that, lookups are plain dictionary reads.
    """

    # pluggy's manager, taking a hook implemented under a deprecated name (pagoda.registry.deprecation) as the new one
    pm: pluggy.PluginManager = field(default_factory=lambda: RenamingPluggy("pagoda"))
    dists: dict[str, str] = field(default_factory=dict)
    # plugin name -> the API range it declared (PAGODA_PLUGIN_API), where it declared one
    api_ranges: dict[str, str] = field(default_factory=dict)
    # plugin name -> distribution, for installed plugins not loaded because PAGODA_DISABLE_PLUGINS names them
    blocked: dict[str, str] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    components: dict[str, dict[str, Component]] = field(default_factory=dict)

    @property
    def hook(self):
        return self.pm.hook

    def load(self, autoload: bool | None = None, disabled: set[str] | None = None) -> "PluginManager":
        """Load the ``pagoda.plugins`` entry points, pagoda's own first (``autoload`` False: only those),
        then build the name registry.

        Built-ins come in the way a third-party plugin does. An entry point whose name is taken already
        is registered as ``<distribution>:<name>``, never dropped.
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
        for ep in own + (others if autoload else []):
            dist_name = ep.dist.name if ep.dist else "unknown"
            dist = BUILTIN_DIST if ep in own else f"{dist_name} {ep.dist.version if ep.dist else ''}".strip()
            name = ep.name if self.pm.get_plugin(ep.name) is None and ep.name not in self.dists else \
                f"{dist_name}:{ep.name}"
            if name in disabled:
                self.blocked[name] = dist
                continue
            self._register(name, dist, ep.load)
        self._build_registry()
        return self

    def register(self, plugin: Any, name: str, dist: str = "local") -> None:
        """Register a plugin object at run time (tests, embedding apps) and
        rebuild the registry."""
        self.pm.register(plugin, name=name)
        self.dists[name] = dist
        self._build_registry()

    def _register(self, name: str, dist: str, load: Callable[[], Any]) -> None:
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
                                f"pagoda {__version__} has plugin API {PLUGIN_API_VERSION} ({problem}); install "
                                f"a release of {dist.split()[0]} made for API {PLUGIN_API_VERSION}, or block it "
                                f"with PAGODA_DISABLE_PLUGINS={name}"))
                return
            self.api_ranges[name] = str(declared)
        try:
            self.pm.register(plugin, name=name)
        except Exception:
            self.failures.append(PluginFailure(name, dist, traceback.format_exc()))
            return
        self.dists[name] = dist

    def _build_registry(self) -> None:
        components: dict[str, dict[str, Component]] = {}
        for hook_name, kind in COMPONENT_HOOKS.items():
            by_name: dict[str, Component] = {}
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                plugin_name = self.pm.get_name(impl.plugin) or repr(impl.plugin)
                dist = self.dists.get(plugin_name, "unknown")
                try:
                    # hooks import their components lazily, so a missing dependency surfaces here
                    mapping = impl.function() or {}
                except Exception:
                    self._record_failure(plugin_name, dist, traceback.format_exc())
                    continue
                for comp_name, factory in mapping.items():
                    if comp_name in by_name:
                        other = by_name[comp_name]
                        raise ConfigError(
                            f"two plugins provide the {kind} {comp_name!r}: plugin "
                            f"{other.plugin!r} from {other.dist} and plugin {plugin_name!r} "
                            f"from {dist}; uninstall one, or block one with "
                            f"PAGODA_DISABLE_PLUGINS={plugin_name}"
                        )
                    by_name[comp_name] = Component(kind, comp_name, factory, plugin_name, dist)
            components[hook_name] = by_name
        self.components = components

    def _record_failure(self, name: str, dist: str, error: str) -> None:
        if not any(f.name == name and f.error == error for f in self.failures):  # the registry is rebuilt
            self.failures.append(PluginFailure(name, dist, error))

    def names(self, hook_name: str) -> list[str]:
        return sorted(self.components.get(hook_name, {}))

    def get(self, hook_name: str, name: str, option: str) -> Component:
        """The component called ``name``, or a ConfigError listing what exists."""
        available = self.components.get(hook_name, {})
        if name in available:
            return available[name]
        kind = COMPONENT_HOOKS[hook_name]
        listing = ", ".join(f"{c.name!r} ({c.dist})" for c in sorted(available.values(), key=lambda c: c.name))
        msg = f"unknown {kind} {name!r} for {option}; available: {listing or 'none'}"
        if self.failures:
            msg += "; plugins that failed to load: " + ", ".join(f"{f.name} ({f.dist}: {f.reason})"
                                                                  for f in self.failures)
            msg += " (run `pagoda plugins` for the details)"
        raise ConfigError(msg)

    def table(self) -> list[Component]:
        """Every component, sorted by kind then name (for ``pagoda plugins``)."""
        rows = [c for by_name in self.components.values() for c in by_name.values()]
        return sorted(rows, key=lambda c: (c.kind, c.name))

    def notify_request_finished(self, request: Any) -> None:
        self.pm.hook.pagoda_request_finished(request=request)


def api_mismatch(declared: str) -> str | None:
    """None if ``declared`` (a version specifier such as ``">=1.0,<2"``) admits this pagoda's plugin API
    version, else what is wrong with it."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        spec = SpecifierSet(declared)
    except InvalidSpecifier:
        return f"{declared!r} is not a version range such as '>=1.0,<2'"
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
    return own, others


def _disabled_from_env() -> set[str]:
    raw = os.environ.get("PAGODA_DISABLE_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> PluginManager:
    """A fresh, loaded plugin manager for this process."""
    return PluginManager().load()
