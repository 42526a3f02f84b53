"""The plugin manager: registers built-ins, loads entry points, resolves names."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from pagoda import hookspecs
from pagoda.env import env_bool
from pagoda.errors import ConfigError

ENTRY_POINT_GROUP = "pagoda.plugins"
BUILTIN_DIST = "pagoda (built-in)"

# Built-in plugins, registered before any third-party one. Each entry is
# (plugin name, module); the same names are listed in pyproject.toml under
# [project.entry-points."pagoda.plugins"], so loading entry points afterwards
# skips them instead of registering them twice.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("loaders", "pagoda.loader"),
    ("models", "pagoda.models"),
    ("kv_paged", "pagoda.kv_blocks"),
    ("sampler", "pagoda.sampler"),
    ("schedulers", "pagoda.plugins.schedulers"),
    ("attention", "pagoda.plugins.attention"),
    ("quant", "pagoda.plugins.quant"),
    ("spec_decode", "pagoda.plugins.spec_decode"),
    ("entrypoints", "pagoda.plugins.entrypoints"),
)

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
    """A plugin that could not be imported or registered."""

    name: str
    dist: str
    error: str


@dataclass
class PluginManager:
    """pluggy's manager plus pagoda's name registry.

    Every process builds its own. ``components`` is filled once, in
    :meth:`load`; after that, lookups are plain dictionary reads.
    """

    pm: pluggy.PluginManager = field(default_factory=lambda: pluggy.PluginManager("pagoda"))
    dists: dict[str, str] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    components: dict[str, dict[str, Component]] = field(default_factory=dict)

    @property
    def hook(self):
        return self.pm.hook

    def load(self, autoload: bool | None = None, disabled: set[str] | None = None) -> "PluginManager":
        """Register built-ins, then entry points, then build the name registry."""
        self.pm.add_hookspecs(hookspecs)
        if disabled is None:
            disabled = _disabled_from_env()
        if autoload is None:
            autoload = env_bool("PAGODA_PLUGIN_AUTOLOAD", True)
        for name in disabled:
            self.pm.set_blocked(name)
        for name, module_name in BUILTIN_PLUGINS:
            if name in disabled:
                continue
            self._register(name, BUILTIN_DIST, lambda m=module_name: importlib.import_module(m))
        if autoload:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in disabled or self.pm.get_plugin(ep.name) is not None:
                    continue
                dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown"
                self._register(ep.name, dist, ep.load)
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
            msg += "; plugins that failed to load: " + ", ".join(f"{f.name} ({f.dist})" for f in self.failures)
            msg += " (run `pagoda plugins` for their tracebacks)"
        raise ConfigError(msg)

    def table(self) -> list[Component]:
        """Every component, sorted by kind then name (for ``pagoda plugins``)."""
        rows = [c for by_name in self.components.values() for c in by_name.values()]
        return sorted(rows, key=lambda c: (c.kind, c.name))

    def notify_request_finished(self, request: Any) -> None:
        self.pm.hook.pagoda_request_finished(request=request)


def _disabled_from_env() -> set[str]:
    raw = os.environ.get("PAGODA_DISABLE_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> PluginManager:
    """A fresh, loaded plugin manager for this process."""
    return PluginManager().load()
