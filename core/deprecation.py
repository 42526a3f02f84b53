"""Deprecated names of the plugin API, and what keeps each one working until its removal.

A hook, component method, base-class method or module that is renamed or removed keeps working, with a
``DeprecationWarning`` that names the old name, its replacement and the version that removes it, through at
least one whole minor version of ``PLUGIN_API_VERSION`` after the one that deprecated it
(docs/plugin-api-changelog.md). :data:`DEPRECATIONS` is
the one list of them; the test suite fails once ``PLUGIN_API_VERSION`` reaches an entry's ``removed_in``,
so the entry and the code that honours it go together.

Kinds, and where each is honoured:

- ``HOOK``: a ``@hookimpl`` under the old hook name implements the new hook, with a warning when the
  plugin is registered (:class:`RenamingPluggy`, the pluggy manager of
  :class:`pagoda.plugin_manager.PluginManager`).
- ``METHOD``: a component built by a factory of hook ``owner`` that has only the old method name gets the
  new one bound to the old method (:func:`adapt_renamed_methods`, called where components are built).
- ``OVERRIDE``: a method of base class ``owner`` that plugins subclass (:func:`adopt_renamed_overrides`,
  called from the base class's ``__init_subclass__``; :func:`renamed_method` for old names plugins call).
- ``MODULE`` and ``ATTRIBUTE``: a module that moved, and a name that moved or was renamed with it
  (:func:`deprecated_module`, called by the stub module left under the old name).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from pagoda.errors import ConfigError

HOOK = "hook"
METHOD = "method"
OVERRIDE = "override"
MODULE = "module"
ATTRIBUTE = "attribute"


@dataclass(frozen=True)
class Deprecation:
    """One deprecated name: ``old`` works like ``new`` from API ``since`` until API ``removed_in``."""

    kind: str
    old: str
    new: str
    since: str
    removed_in: str
    # METHOD: the hook whose factories build the component; OVERRIDE: the base class's name
    owner: str = ""

    @property
    def old_name(self) -> str:
        """The old name as a user wrote it (``TokenBudgetScheduler._insert_waiting``)."""
        return f"{self.owner}.{self.old}" if self.kind == OVERRIDE else self.old

    def describe(self) -> str:
        return f"deprecated in pagoda plugin API {self.since} and removed in {self.removed_in}"


_SCHEDULER_BASE = "TokenBudgetScheduler"

# Every deprecated name. The renames made before the API was versioned count as deprecated in 1.0.
# No hook and no component method has been renamed yet.
DEPRECATIONS: tuple[Deprecation, ...] = (
    Deprecation(MODULE, "pagoda.request", "pagoda.sequence", "1.0", "1.2"),
    Deprecation(ATTRIBUTE, "pagoda.request.Request", "pagoda.sequence.Sequence", "1.0", "1.2"),
    Deprecation(ATTRIBUTE, "pagoda.request.RequestStatus", "pagoda.sequence.SequenceStatus", "1.0", "1.2"),
    Deprecation(MODULE, "pagoda.kv_cache", "pagoda.kv_blocks", "1.0", "1.2"),
    Deprecation(MODULE, "pagoda.attention_batch", "pagoda.step", "1.0", "1.2"),
    Deprecation(MODULE, "pagoda.plugins.schedulers.fcfs", "pagoda.plugins.schedulers.base", "1.0", "1.2"),
    # queue helpers the base class still calls, so an override is honoured as it is
    Deprecation(OVERRIDE, "_insert_waiting", "waiting_key", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_insert_running", "running_key", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_insert_swapped", "running_key", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_running_order", "running_key", "1.0", "1.2", _SCHEDULER_BASE),
    # plain renames: an override is installed under the new name
    Deprecation(OVERRIDE, "_pick_victim", "choose_victim", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_may_admit_waiting", "may_admit", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_preempt_for_arrivals", "preempt_for_arrivals", "1.0", "1.2", _SCHEDULER_BASE),
    # an action policies call: the old name forwards, an override of it is refused
    Deprecation(OVERRIDE, "_preempt", "preempt", "1.0", "1.2", _SCHEDULER_BASE),
)


def deprecations(kind: str, owner: str | None = None) -> list[Deprecation]:
    """The entries of one kind (and owner)."""
    return [d for d in DEPRECATIONS if d.kind == kind and (owner is None or d.owner == owner)]


def _find(kind: str, old: str, owner: str = "") -> Deprecation | None:
    return next((d for d in deprecations(kind) if d.old == old and d.owner == owner), None)


# ---- hooks ---------------------------------------------------------------------------------------


class RenamingPluggy(pluggy.PluginManager):
    """pluggy's manager, registering a hookimpl under a deprecated hook name for the new hook.

    Plain pluggy would register the old name as a hook of its own that nothing calls (and that
    ``check_pending`` rejects as unknown): the plugin would be silently ignored.
    """

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin``, warning for each hook it implements under a deprecated name; refuse one
        that implements both the old and the new name (the hook would run twice)."""
        plugin_name = name or self.get_canonical_name(plugin)
        for d in deprecations(HOOK):
            if super().parse_hookimpl_opts(plugin, d.old) is None:
                continue
            if super().parse_hookimpl_opts(plugin, d.new) is not None:
                raise ConfigError(f"plugin {plugin_name!r} implements both {d.old} and {d.new}, which replaces "
                                  f"it; delete {d.old}")
            warnings.warn(f"plugin {plugin_name!r} implements the hook {d.old}, {d.describe()}: rename it to "
                          f"{d.new}", DeprecationWarning, stacklevel=4)
        return super().register(plugin, name)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        renamed = _find(HOOK, name)
        if opts is None or renamed is None or opts.get("specname"):
            return opts
        return {**opts, "specname": renamed.new}


# ---- methods of built components -----------------------------------------------------------------


def adapt_renamed_methods(component: Any, hook_name: str, component_name: str) -> Any:
    """``component`` (built by a factory of ``hook_name``), with each renamed method it has only under
    its old name bound under the new one too, so the engine's calls reach it. Returns ``component``."""
    for d in deprecations(METHOD, hook_name):
        if hasattr(component, d.new) or not hasattr(component, d.old):
            continue
        warnings.warn(f"{component_name!r} ({type(component).__qualname__}, from {hook_name}) has the method "
                      f"{d.old}, {d.describe()}: rename it to {d.new}",
                      DeprecationWarning, stacklevel=2)
        setattr(component, d.new, getattr(component, d.old))
    return component


# ---- methods of base classes plugins subclass ----------------------------------------------------


def renamed_method(owner: str, old: str) -> Callable[..., Any]:
    """A method for base class ``owner`` under the deprecated name ``old``: it warns and calls the new
    name. Overriding it is refused by :func:`adopt_renamed_overrides`, since the base never calls it."""
    d = _find(OVERRIDE, old, owner)
    if d is None:
        raise LookupError(f"{owner}.{old} is not in pagoda.deprecation.DEPRECATIONS")

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"{d.old_name} is {d.describe()}: call {d.new}", DeprecationWarning, stacklevel=2)
        return getattr(self, d.new)(*args, **kwargs)

    forward.__name__ = old
    forward.__doc__ = f"Deprecated: calls :meth:`{d.new}`."
    forward.deprecation = d  # type: ignore[attr-defined]
    return forward


def adopt_renamed_overrides(cls: type, base: type) -> None:
    """Honour the methods subclass ``cls`` of ``base`` defines under deprecated names, with a warning.

    An old name the base still calls needs nothing more; an old name the base no longer has is a plain
    rename, so the override is installed under the new name. A class defining both names, or overriding
    a name the base only keeps for callers (see :func:`renamed_method`), is refused: its override would
    otherwise be silently ignored.
    """
    where = f"{cls.__module__}.{cls.__qualname__}"
    for d in deprecations(OVERRIDE, base.__name__):
        if d.old not in vars(cls):
            continue
        if d.new in vars(cls):
            raise TypeError(f"{where} defines both {d.old_name}, {d.describe()}, and {d.new}, which "
                            f"replaces it; delete {d.old}")
        inherited = getattr(base, d.old, None)
        if hasattr(inherited, "deprecation"):
            raise TypeError(f"{where} overrides {d.old_name}, {d.describe()}, which {base.__name__} no longer "
                            f"calls: override {d.new} instead")
        warnings.warn(f"{where} overrides {d.old_name}, {d.describe()}: override {d.new} instead",
                      DeprecationWarning, stacklevel=3)
        if inherited is None:
            setattr(cls, d.new, vars(cls)[d.old])


# ---- modules -------------------------------------------------------------------------------------


def deprecated_module(module_name: str) -> Callable[[str], Any]:
    """Warn that ``module_name`` moved, and return the ``__getattr__`` that its stub module defines: each
    name resolves to the new module's (or, for a renamed one, to its new name), with a warning."""
    moved = _find(MODULE, module_name)
    if moved is None:
        raise LookupError(f"{module_name} is not in pagoda.deprecation.DEPRECATIONS")
    warnings.warn(f"the module {module_name} is {moved.describe()}: import {moved.new} instead",
                  DeprecationWarning, stacklevel=3)

    def __getattr__(name: str) -> Any:
        renamed = _find(ATTRIBUTE, f"{module_name}.{name}")
        target = renamed.new if renamed is not None else f"{moved.new}.{name}"
        new_module, _, new_name = target.rpartition(".")
        if name.startswith("__") or not hasattr(importlib.import_module(new_module), new_name):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r} (the module is "
                                 f"{moved.describe()}; see {moved.new})")
        warnings.warn(f"{module_name}.{name} is {(renamed or moved).describe()}: use {target} instead",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__

