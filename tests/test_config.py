"""Host settings are engine options: an option given wins, else its environment variable, else the default;
resolved once, when the engine's config is built."""

import dataclasses

import os

import pytest

from pagoda.engine.engine_args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.host.env import (HOST_CHOICES, HOST_OPTIONS, HOST_VARIABLES, PROCESS_WIDE, HostConfig,
                             resolve_host_config)
from pagoda.host.openmp import WAIT_POLICIES

# a value of each host setting other than its built-in default, as an option and as its variable's text
NOT_DEFAULT = {
    "cpu_threads": (2, "2"),
    "thread_recheck_seconds": (0.5, "0.5"),
    "omp_wait_policy": ("sleep", "SLEEP"),
    "malloc_tuning": (False, "off"),
    "huge_pages": (False, "0"),
    "kv_cache_prefault": (True, "on"),
    "cpu_isa": ("avx2", "avx2"),
    "cpu_native_build": (False, "no"),
    "fused_cpu_ops": (False, "False"),
    "onednn_packed_weights": (False, "0"),
    "cpu_prefill_kernel": (False, "off"),
    "cpu_linear_kernel": ("packed", "PACKED"),
    "quant_kernel": ("torch", "torch"),
}


@pytest.fixture
def clean_environment(monkeypatch):
    for variable in HOST_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_every_host_setting_is_an_engine_option_with_a_variable_made_from_one_list():
    names = [f.name for f in dataclasses.fields(HostConfig)]
    assert set(names) == set(NOT_DEFAULT)
    assert list(HOST_VARIABLES) == names == [option.name for option in HOST_OPTIONS]
    assert set(HOST_VARIABLES) <= set(EngineArgs.model_fields)
    for option in HOST_OPTIONS:  # the option's help names its variable and built-in default, from the field
        field = EngineArgs.model_fields[option.name]
        assert field.default is None and option.help in field.description and option.variable in field.description
    assert set(PROCESS_WIDE) == {"cpu_threads", "thread_recheck_seconds", "omp_wait_policy", "malloc_tuning"}


def test_without_options_or_variables_the_settings_are_the_built_in_defaults(clean_environment):
    assert resolve_host_config() == HostConfig()
    assert EngineArgs().host_config() == HostConfig()


@pytest.mark.parametrize("name", sorted(NOT_DEFAULT))
def test_a_variable_is_the_default_of_its_option_and_the_option_wins(clean_environment, name):
    option_value, variable_text = NOT_DEFAULT[name]
    clean_environment.setenv(HOST_VARIABLES[name], variable_text)
    assert getattr(EngineArgs().host_config(), name) == option_value
    builtin = getattr(HostConfig(), name)
    given = builtin if builtin is not None else 1  # None is "not given" (cpu_threads: measured)
    assert getattr(EngineArgs(**{name: given}).host_config(), name) == given


@pytest.mark.parametrize("name", sorted(n for n, (value, _) in NOT_DEFAULT.items() if isinstance(value, bool)))
def test_a_malformed_boolean_variable_is_an_error_naming_it(clean_environment, name):
    clean_environment.setenv(HOST_VARIABLES[name], "maybe")
    with pytest.raises(ConfigError, match=f"{HOST_VARIABLES[name]}='maybe' is not a boolean; set it to one of 1, "
                                          "true, yes, on"):
        EngineArgs().host_config()


def test_a_malformed_variable_fails_when_the_config_is_built_before_the_model_is_read(clean_environment, tmp_path):
    clean_environment.setenv("PAGODA_QUANT_KERNEL", "fast")
    with pytest.raises(ConfigError, match="PAGODA_QUANT_KERNEL='fast' is not one of auto, cpu, torch, triton"):
        EngineArgs(model=str(tmp_path / "missing")).create_engine_config()
    clean_environment.delenv("PAGODA_QUANT_KERNEL")
    clean_environment.setenv("PAGODA_CPU_THREADS", "all")
    with pytest.raises(ConfigError, match="PAGODA_CPU_THREADS='all' is not a whole number >= 1"):
        EngineArgs(model=str(tmp_path / "missing")).create_engine_config()


def test_a_bad_option_value_is_refused_with_the_allowed_ones():
    with pytest.raises(ConfigError, match="cpu_isa='avx3'.*'auto', 'generic', 'avx2', 'avx512' or 'avx512_bf16'"):
        EngineArgs.build(cpu_isa="avx3")
    with pytest.raises(ConfigError, match="thread_recheck_seconds=-1"):
        EngineArgs.build(thread_recheck_seconds=-1)


def test_the_engine_config_holds_the_resolved_settings_and_thread_count(clean_environment, tmp_path):
    from tiny_models import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path))
    clean_environment.setenv("PAGODA_CPU_THREADS", "3")
    clean_environment.setenv("PAGODA_FUSED_CPU_OPS", "off")
    config = EngineArgs(model=model, huge_pages=False).create_engine_config()
    assert config.parallel.cpu_threads == 3
    assert config.host == HostConfig(cpu_threads=3, huge_pages=False, fused_cpu_ops=False)
    assert config.model.host is config.host  # the components the engine builds get its settings
    assert EngineArgs(model=model, cpu_threads=1).create_engine_config().parallel.cpu_threads == 1
    clean_environment.delenv("PAGODA_CPU_THREADS")
    assert EngineArgs(model=model).create_engine_config().parallel.cpu_threads is None  # measured


def test_the_wait_policies_an_option_accepts_are_those_openmp_knows():
    assert HOST_CHOICES["omp_wait_policy"] == WAIT_POLICIES


def test_tensor_parallel_ranks_share_the_cores_unless_told():
    cfg = EngineArgs(tensor_parallel_size=2).create_engine_config()
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.parallel.distributed_executor_backend == "auto"
    assert cfg.parallel.cpu_threads == max(1, (os.cpu_count() or 1) // 2)
    assert EngineArgs(tensor_parallel_size=2, cpu_threads=3).create_engine_config().parallel.cpu_threads == 3


