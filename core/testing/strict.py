"""Strict contracts: the engine on the default model with every component behind a proxy that records each
attribute used outside the component's Protocol in :mod:`pagoda.interfaces`.

A plugin's component that reaches into another one (a scheduler reading its allocator's private books,
say) works today and breaks in the next release; behind these proxies the run names every such access::

    def test_my_scheduler_stays_inside_the_contracts(pagoda_strict_llm):
        llm = pagoda_strict_llm(scheduling_policy="my-policy", kv_cache_memory_bytes=8 << 20)
        llm.generate(["Hello"] * 8, SamplingParams(max_tokens=16))
        # the fixture fails the test at teardown, naming each attribute used outside a Protocol

Without pytest: ``StrictContracts().llm(...)``, then ``assert_clean()``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Optional

from pagoda import interfaces
from pagoda.registry.adapt import OPTIONAL_MEMBERS, OPTIONAL_OFFLOAD_MEMBERS
from pagoda.registry.plugin_manager import PluginManager
from pagoda.scheduling import SchedulingPolicy
from pagoda.testing.contract import ContractError

_PROTOCOL_INTERNALS = set(dir(typing.Protocol)) | {"__protocol_attrs__", "__non_callable_proto_members__",
                                                   "_is_protocol", "_is_runtime_protocol", "__abstractmethods__"}


def contract_names(protocol: type) -> set[str]:
    """The attributes and methods a Protocol lists (its own and its bases' up to Protocol)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (typing.Protocol, typing.Generic, object):
            continue
        names |= set(vars(cls)) | set(getattr(cls, "__annotations__", {}))
    return {n for n in names if n not in _PROTOCOL_INTERNALS and not (n.startswith("__") and n != "__call__")}


class Proxy:
    """Forwards to ``target``; records in ``violations`` every attribute used that ``protocol`` does not
    list (and every attribute set from outside), so one run names them all."""

    def __init__(self, target: Any, protocol: type, violations: set, optional: frozenset = frozenset()) -> None:
        """``optional``: the Protocol's optional members, which pagoda itself sets on a component lacking them
        (``pagoda.registry.adapt``): setting one of those the target lacks is no violation."""
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_protocol", protocol)
        object.__setattr__(self, "_allowed", contract_names(protocol))
        object.__setattr__(self, "_violations", violations)
        object.__setattr__(self, "_optional", optional)

    def __getattr__(self, name: str) -> Any:
        if name not in self._allowed:
            self._violations.add(f"{self._protocol.__name__}.{name} is used but not in the Protocol")
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name in self._optional and not hasattr(self._target, name)):  # else pagoda sets a default
            self._violations.add(f"{self._protocol.__name__}.{name} is set from outside the component")
        setattr(self._target, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "__call__" not in self._allowed:
            self._violations.add(f"{self._protocol.__name__} is called but __call__ is not in the Protocol")
        return self._target(*args, **kwargs)


class QuantProxy(Proxy):
    """A quant method whose per-layer linear methods are proxied too."""

    def for_layer(self, prefix: str) -> Optional[Proxy]:
        method = self._target.for_layer(prefix)
        return None if method is None else Proxy(method, interfaces.LinearMethod, self._violations)


class ExecutorProxy(Proxy):
    """An executor whose runner is proxied too: the engine and the commands read it as a ModelRunnerView."""

    @property
    def runner(self) -> Proxy:
        if "_runner" not in vars(self):
            object.__setattr__(self, "_runner", Proxy(self._target.runner, interfaces.ModelRunnerView,
                                                      self._violations))
        return vars(self)["_runner"]


# component hook -> the Protocol its components are held to, and the proxy class
STRICT_HOOKS: dict[str, tuple[type, type]] = {
    "pagoda_model_architectures": (interfaces.CausalLM, Proxy),
    "pagoda_model_loaders": (interfaces.ModelLoader, Proxy),
    "pagoda_quant_methods": (interfaces.QuantMethod, QuantProxy),
    "pagoda_kv_allocators": (interfaces.KVCacheManager, Proxy),
    "pagoda_schedulers": (SchedulingPolicy, Proxy),
    "pagoda_attention_backends": (interfaces.AttentionBackend, Proxy),
    "pagoda_samplers": (interfaces.Sampler, Proxy),
    "pagoda_lora_backends": (interfaces.LoRABackend, Proxy),
    "pagoda_proposers": (interfaces.Proposer, Proxy),
    "pagoda_executors": (interfaces.Executor, ExecutorProxy),
}


def strict_factory(factory: Callable[..., Any], protocol: type, violations: set, proxy: type = Proxy,
                   hook: str = "") -> Callable:
    """``factory``, building its component behind ``proxy``; the factory's public class attributes (such as
    ``auto_priority``, ``supports_tensor_parallel``) stay readable on it. ``hook``: the component hook, whose
    optional members pagoda may set on the component."""
    optional = frozenset(OPTIONAL_MEMBERS.get(hook, {})) | (
        frozenset(OPTIONAL_OFFLOAD_MEMBERS) if hook == "pagoda_kv_allocators" else frozenset())

    def build(*args: Any, **kwargs: Any) -> Any:
        return proxy(factory(*args, **kwargs), protocol, violations, optional)

    for name in dir(factory):
        if not name.startswith("_") and not callable(getattr(factory, name, None)):
            setattr(build, name, getattr(factory, name))
    build.__name__ = getattr(factory, "__name__", "factory")
    return build


class StrictContracts:
    """Builds engines whose components are all behind their Protocols' proxies; ``violations`` collects what
    any of them used outside a Protocol, over every engine built."""

    def __init__(self, plugins: Optional[dict[str, Any]] = None) -> None:
        """``plugins``: plugin objects to register by name next to the installed ones (a plugin not packaged)."""
        self.violations: set[str] = set()
        self.plugins = dict(plugins or {})

    def plugin_manager(self) -> PluginManager:
        """Every installed plugin (and ``plugins``), loaded, with the factories of ``STRICT_HOOKS`` wrapped."""
        pm = PluginManager().load()
        for name, plugin in self.plugins.items():
            pm.register(plugin, name=name)
        for hook, (protocol, proxy) in STRICT_HOOKS.items():
            strict = {id(c): dataclasses.replace(c, factory=strict_factory(c.factory, protocol, self.violations, proxy,
                                                                           hook))
                      for found in pm.providers.get(hook, {}).values() for c in found}
            pm.components[hook] = {name: strict[id(c)] for name, c in pm.components.get(hook, {}).items()}
            pm.providers[hook] = {name: [strict[id(c)] for c in found] for name, found in pm.providers[hook].items()}
        return pm

    def llm(self, **options: Any) -> Any:
        """``pagoda.LLM(**options)`` on the default model (unless ``model`` is given), float32, one thread."""
        from pagoda.engine.llm import LLM

        defaults = dict(dtype="float32", max_model_len=512, cpu_threads=1)
        return LLM(plugin_manager=self.plugin_manager(), **{**defaults, **options})

    def assert_clean(self) -> None:
        if self.violations:
            raise ContractError("components were used outside their Protocols in pagoda.interfaces (rule broken: a "
                                "component touches another only through its Protocol; most likely at fault: the "
                                "component whose code uses the attribute):\n  " + "\n  ".join(sorted(self.violations)))
