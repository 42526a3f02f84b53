"""The built-in components meet the contracts of pagoda.interfaces, as a third-party one must."""

import pytest

from pagoda import interfaces
from pagoda.engine.engine_args import EngineArgs
from pagoda.registry.plugin_manager import get_plugin_manager


@pytest.fixture(scope="module")
def engine_parts():
    from pagoda.engine.components import build_components

    config = EngineArgs.build(dtype="float32", load_format="dummy", kv_cache_memory_bytes=1 << 24,
                              attention_backend="torch").create_engine_config()
    return build_components(config, get_plugin_manager())


def test_built_in_components_satisfy_their_protocols(engine_parts):
    assert isinstance(engine_parts.kv_manager, interfaces.KVCacheManager)
    assert isinstance(engine_parts.scheduler, interfaces.Scheduler)
    assert isinstance(engine_parts.backend, interfaces.AttentionBackend)
    assert isinstance(engine_parts.runner.sampler, interfaces.Sampler)
    assert isinstance(engine_parts.model, interfaces.CausalLM)


def test_kv_cache_shape_has_exactly_one_axis_that_grows_with_blocks(engine_parts):
    one, two = engine_parts.backend.kv_cache_shape(1), engine_parts.backend.kv_cache_shape(2)
    assert sum(a != b for a, b in zip(one, two)) == 1


def test_every_hook_named_in_the_plugin_table_has_a_spec():
    pm = get_plugin_manager()
    specs = {name for name in dir(pm.hook) if name.startswith("pagoda_")}
    assert {"pagoda_schedulers", "pagoda_attention_backends", "pagoda_kv_allocators", "pagoda_samplers",
            "pagoda_model_loaders", "pagoda_model_architectures", "pagoda_quant_methods", "pagoda_proposers",
            "pagoda_cli_commands", "pagoda_add_routes", "pagoda_request_finished"} <= specs
