"""pagoda.registry.adapt: every component pagoda builds gets the defaults of the optional Protocol members it
lacks, and keeps the ones it has."""

from __future__ import annotations

import torch

from pagoda.interfaces import has_offload_tiers
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.registry.adapt import adapt_component
from pagoda.step import KVTierMoves


class BareBackend:
    """An attention backend written before name, isa_paths and kv_cache_dtype were declared."""


class FullBackend:
    name = "full"

    def __init__(self) -> None:
        self.kv_cache_dtype = torch.float16

    def isa_paths(self) -> dict[str, str]:
        return {"decode attention": "scalar"}


def test_a_backend_without_the_optional_members_gets_their_defaults():
    backend = adapt_component(BareBackend(), "pagoda_attention_backends", "bare-by-name")
    assert backend.name == "bare-by-name"  # the name it was selected by
    assert backend.kv_cache_dtype is None  # the model's dtype
    assert backend.isa_paths() == {}
    assert backend.batch_invariant is False  # refused by the batch-invariant mode


def test_a_backend_keeps_the_optional_members_it_has():
    backend = adapt_component(FullBackend(), "pagoda_attention_backends", "selected-name")
    assert (backend.name, backend.kv_cache_dtype) == ("full", torch.float16)
    assert backend.isa_paths() == {"decode attention": "scalar"}


def test_samplers_and_models_without_the_flags_get_false():
    class Sampler:
        def __call__(self, logits, requests):
            raise AssertionError("not called")

    class Model(torch.nn.Module):
        pass

    sampler = adapt_component(Sampler(), "pagoda_samplers", "s")
    assert sampler.samples_standard_distribution is False and sampler.batch_invariant is False
    assert adapt_component(Model(), "pagoda_model_architectures", "m").runs_first_layers_of_caches is False


class NoSwapBooks:
    """A KV allocator without is_swapped and without offload tiers."""


class TiersWithoutSpill:
    """A KV allocator with the 1.2 offload group (take_tier_moves, ...) but no spill_to_disk."""

    tiers = None

    def take_tier_moves(self) -> KVTierMoves:
        return KVTierMoves()


def test_an_allocator_without_is_swapped_never_reports_a_swapped_sequence():
    kv = adapt_component(NoSwapBooks(), "pagoda_kv_allocators", "books")
    assert kv.is_swapped("any request") is False
    assert not has_offload_tiers(kv) and not hasattr(kv, "spill_to_disk")  # no tiers: no tier member added


def test_an_allocator_with_the_offload_group_but_no_spill_to_disk_spills_nothing():
    kv = adapt_component(TiersWithoutSpill(), "pagoda_kv_allocators", "tiers")
    assert has_offload_tiers(kv) and not kv.spill_to_disk()


def test_the_paged_allocator_keeps_its_own_members():
    kv = PagedKVCacheManager(8, 16)
    adapted = adapt_component(kv, "pagoda_kv_allocators", "paged")
    assert adapted is kv and "is_swapped" not in vars(kv) and "spill_to_disk" not in vars(kv)
