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
  :class:`pagoda.registry.plugin_manager.PluginManager`).
- ``METHOD``: a component built by a factory of hook ``owner`` that has only the old method name gets the
  new one bound to the old method (:func:`adapt_renamed_methods`, called where components are built).
- ``OVERRIDE``: a method of base class ``owner`` that plugins subclass: a subclass's override under the old
  name is honoured, or refused if ``refused`` says why it cannot be, when the subclass is created
  (:func:`adopt_renamed_overrides`, called from the base class's ``__init_subclass__``); the base keeps the
  old name of a plain rename for code that calls it (:func:`renamed_method`). Once removed, an override
  the base would no longer call is refused (:data:`REMOVED_OVERRIDES`).
- ``MODULE`` and ``ATTRIBUTE``: a module that moved, and a name that moved or was renamed with it
  (:func:`deprecated_module`, called by the stub module left under the old name).
- ``CALLED``: a method of a contract class that plugins call but do not subclass (``owner``, e.g.
  ``Sequence``): the class keeps the old name as a method that warns and calls what replaces it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
CALLED = "called"


@dataclass(frozen=True)
class Deprecation:
    """One deprecated name: ``old`` works like ``new`` from API ``since`` until API ``removed_in``."""

    kind: str
    old: str
    new: str
    since: str
    removed_in: str
    # METHOD: the hook whose factories build the component; OVERRIDE: the base class's name; CALLED: the class's
    owner: str = ""
    # OVERRIDE: why an override under the old name cannot stand in for the new method (it is then refused
    # when the subclass is created, rather than silently ignored)
    refused: str = ""

    @property
    def old_name(self) -> str:
        """The old name as a user wrote it (``Sampler._apply_penalties``)."""
        return f"{self.owner}.{self.old}" if self.kind in (OVERRIDE, CALLED) else self.old

    def describe(self) -> str:
        return f"deprecated in pagoda plugin API {self.since} and removed in {self.removed_in}"


_SCHEDULER_BASE = "TokenBudgetScheduler"
_SAMPLER_BASE = "Sampler"

# Every deprecated name. No hook, component method or module is renamed now (the modules moved in 1.3 kept
# their old names until 1.5); no base-class method is deprecated now.
DEPRECATIONS: tuple[Deprecation, ...] = (
    # appending one token without its stop conditions: append_output_tokens is the one place tokens are appended
    Deprecation(CALLED, "append_output_token", "append_output_tokens", "1.4", "2.0", "Sequence"),
)

# Base-class methods removed from the API whose overrides the base no longer calls under any name: a
# subclass that still defines one is refused when it is created, with what replaces it, instead of running
# without it. (Removed modules need no entry: importing one is a ModuleNotFoundError.) An entry stays until
# the next major version.
REMOVED_OVERRIDES: tuple[Deprecation, ...] = (
    Deprecation(OVERRIDE, "_pick_victim", "choose_victim", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_may_admit_waiting", "may_admit", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_preempt_for_arrivals", "preempt_for_arrivals", "1.0", "1.2", _SCHEDULER_BASE),
    Deprecation(OVERRIDE, "_preempt", "preempt", "1.0", "1.2", _SCHEDULER_BASE),
    # the sampler's private steps, public extension points since 1.1
    Deprecation(OVERRIDE, "_apply_penalties", "apply_penalties", "1.1", "1.3", _SAMPLER_BASE),
    Deprecation(OVERRIDE, "_apply_bias_and_min_tokens", "apply_bias_and_bans", "1.1", "1.3", _SAMPLER_BASE),
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
    """The method base class ``owner`` keeps under the deprecated name ``old`` of a plain rename: it warns
    and calls what that name means now (see :func:`_implementation_for_old_name`)."""
    d = _find(OVERRIDE, old, owner)
    if d is None or d.refused:
        raise LookupError(f"{owner}.{old} is not a plain rename in pagoda.registry.deprecation.DEPRECATIONS")

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"{d.old_name} is {d.describe()}: call {d.new}", DeprecationWarning, stacklevel=2)
        return _implementation_for_old_name(type(self), d).__get__(self)(*args, **kwargs)

    forward.__name__ = old
    forward.__doc__ = f"Deprecated: calls :meth:`{d.new}`."
    forward.deprecation = d  # type: ignore[attr-defined]
    return forward


def _implementation_for_old_name(cls: type, d: Deprecation) -> Any:
    """A call of the old name that reaches the base class comes either from ``super()`` in the last class
    of ``cls``'s MRO that overrides the old name, and means the new name's next implementation after it,
    or (with no such class) from code calling ``self.<old>()``, and means the new name's first one."""
    mro = cls.__mro__
    overriding = [i for i, k in enumerate(mro) if d.old in vars(k) and not hasattr(vars(k)[d.old], "deprecation")]
    start = overriding[-1] + 1 if overriding else 0
    return next(vars(k)[d.new] for k in mro[start:] if d.new in vars(k))


def adopt_renamed_overrides(cls: type, base: type) -> None:
    """Honour the methods subclass ``cls`` of ``base`` defines under deprecated names, with a warning.

    An old name the base still calls itself (a private helper) needs nothing more. For a plain rename (the
    base keeps the old name only through :func:`renamed_method`) the override is installed under the new
    name, which is what the base calls. A class defining both names, overriding a name whose override
    cannot stand in for the new method (``refused``), or overriding a removed name
    (:data:`REMOVED_OVERRIDES`) is refused: its override would otherwise be silently ignored.
    """
    where = f"{cls.__module__}.{cls.__qualname__}"
    for d in REMOVED_OVERRIDES:
        if d.owner == base.__name__ and d.old in vars(cls):
            raise TypeError(f"{where} overrides {d.old_name}, which {base.__name__} no longer calls (it was "
                            f"{d.describe()}): override {d.new} instead")
    for d in deprecations(OVERRIDE, base.__name__):
        if d.old not in vars(cls):
            continue
        if d.new in vars(cls):
            raise TypeError(f"{where} defines both {d.old_name}, {d.describe()}, and {d.new}, which "
                            f"replaces it; delete {d.old}")
        if d.refused:
            raise TypeError(f"{where} overrides {d.old_name}, {d.describe()}, and {d.refused}: override "
                            f"{d.new} instead")
        warnings.warn(f"{where} overrides {d.old_name}, {d.describe()}: override {d.new} instead",
                      DeprecationWarning, stacklevel=3)
        if hasattr(getattr(base, d.old, None), "deprecation"):
            setattr(cls, d.new, vars(cls)[d.old])


# ---- modules -------------------------------------------------------------------------------------


def deprecated_module(module_name: str) -> Callable[[str], Any]:
    """Warn that ``module_name`` moved, and return the ``__getattr__`` that its stub module defines: each
    name resolves to the new module's (or, for a renamed one, to its new name), with a warning."""
    moved = _find(MODULE, module_name)
    if moved is None:
        raise LookupError(f"{module_name} is not in pagoda.registry.deprecation.DEPRECATIONS")
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


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module (a ``MODULE`` entry with no stub file left under the old name), or a module
    inside a moved package, as the module under its new name, with a warning: ``import pagoda.kv_blocks``
    gives ``pagoda.kv.blocks`` itself, ``import pagoda.layers.linear`` gives ``pagoda.modeling.layers.linear``.

    First on ``sys.meta_path`` (so a moved package's old name never loads a second copy of its modules) and
    answering for the old names only; installed when ``pagoda`` is imported.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith("pagoda.") or moved_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        moved, new = moved_name(spec.name)
        warnings.warn(f"the module {spec.name} is {moved.describe()}: import {new} instead",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """The new module ran when it was imported; nothing more to do."""


def moved_name(fullname: str) -> tuple[Deprecation, str] | None:
    """The ``MODULE`` entry covering ``fullname`` (the module or a package holding it) and its new name."""
    parts = fullname.split(".")
    for i in range(len(parts), 1, -1):
        moved = _find(MODULE, ".".join(parts[:i]))
        if moved is not None:
            return moved, ".".join([moved.new, *parts[i:]])
    return None


def install_moved_modules() -> None:
    """Put :class:`MovedModuleFinder` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
