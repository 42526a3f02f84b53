"""What pagoda does to every component it builds from a plugin's factory, so that core and the built-in plugins
reach it through its Protocol alone, reading each declared member directly.

An *optional* member of its Protocol (``pagoda.interfaces`` says which, and their defaults) that the
  component lacks is set on it to the default: a plugin written for an earlier plugin API, or one that
  leaves out what it has no use for, works as it did.
"""

from __future__ import annotations

from typing import Any, Callable

from pagoda.interfaces import has_offload_tiers
from pagoda.step import KVTierMoves


def _no_isa_paths() -> dict[str, str]:
    return {}


def _never_swapped(request_id: str) -> bool:
    return False


def _no_windows() -> dict[int, int]:
    return {}


def _nothing_to_spill() -> KVTierMoves:
    return KVTierMoves()


# hook -> optional member -> its default, given the component and the name it was selected by
OPTIONAL_MEMBERS: dict[str, dict[str, Callable[[Any, str], Any]]] = {
    "pagoda_attention_backends": {
        "name": lambda component, name: name,
        "kv_cache_dtype": lambda component, name: None,  # the model's dtype
        "isa_paths": lambda component, name: _no_isa_paths,
        "attention_features": lambda component, name: frozenset(),  # plain causal attention only
        "batch_invariant": lambda component, name: False,
    },
    "pagoda_kv_allocators": {"is_swapped": lambda component, name: _never_swapped},
    "pagoda_samplers": {"samples_standard_distribution": lambda component, name: False,
                        "batch_invariant": lambda component, name: False},
    "pagoda_model_architectures": {
        "runs_first_layers_of_caches": lambda component, name: False,
        "packed_modules_mapping": lambda component, name: {},  # no fused layer: adapters map one to one
        "attention_features": lambda component, name: set(),  # asks nothing beyond causal attention
        "layer_windows": lambda component, name: _no_windows,  # no layer with a window: no window pool
        "supports_lora": lambda component, name: True,
    },
}


# the optional members of the offload-tier group (pagoda.interfaces.KVOffloadTiers), which is optional as a
# whole: only a KV allocator that has the group gets these defaults
OPTIONAL_OFFLOAD_MEMBERS: dict[str, Callable[[Any, str], Any]] = {
    "spill_to_disk": lambda component, name: _nothing_to_spill}


def adapt_component(component: Any, hook_name: str, component_name: str) -> Any:
    """``component``, built by the factory registered as ``component_name`` under ``hook_name``, with its
    defaults of the optional members it lacks. Returns ``component``."""
    optional = dict(OPTIONAL_MEMBERS.get(hook_name, {}))
    if hook_name == "pagoda_kv_allocators" and has_offload_tiers(component):
        optional.update(OPTIONAL_OFFLOAD_MEMBERS)
    for member, default in optional.items():
        if not hasattr(component, member):
            setattr(component, member, default(component, component_name))
    return component
