"""The CPU's ISA level is read from its flags and can be capped, so one machine tests every kernel path."""

import pytest

from pagoda.host import cpu_isa

ZEN1 = frozenset("fpu sse4_2 avx avx2 fma f16c bmi2".split())
SKYLAKE_SP = ZEN1 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN4 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni"}


@pytest.mark.parametrize("flags, level", [(frozenset(), "generic"), (ZEN1 - {"f16c"}, "generic"), (ZEN1, "avx2"),
                                          (SKYLAKE_SP, "avx512"), (ZEN4, "avx512_bf16"),
                                          (ZEN1 | {"avx512_bf16"}, "avx2")])
def test_the_level_is_the_highest_whose_flags_and_every_lower_levels_are_present(flags, level):
    assert cpu_isa.detected_level(flags) == level


def test_a_cap_lowers_the_level_but_never_raises_it():
    detected = cpu_isa.detected_level(cpu_isa.cpu_flags())
    assert cpu_isa.cpu_isa("auto") == detected and not cpu_isa.is_capped("auto")
    assert cpu_isa.cpu_isa("generic") == "generic"
    assert cpu_isa.cpu_isa("avx512_bf16") == detected


def test_without_an_engines_cap_the_environment_caps(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_ISA", "generic")
    assert cpu_isa.cpu_isa() == "generic"
    assert cpu_isa.describe() == "generic" or cpu_isa.describe().endswith("capped by --cpu-isa)")


def test_an_unknown_cap_names_the_levels(monkeypatch):
    from pagoda.errors import ConfigError
    from pagoda.host.env import resolve_host_config

    with pytest.raises(ConfigError, match="cpu_isa 'avx1024' is not a CPU level; use auto or one of generic, avx2"):
        cpu_isa.cpu_isa("avx1024")
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx1024")
    with pytest.raises(ConfigError, match="PAGODA_CPU_ISA='avx1024' is not one of auto, generic, avx2, avx512"):
        resolve_host_config()


def test_a_capped_kernel_build_has_its_own_name_and_only_its_levels_flags():
    assert cpu_isa.extension_build("pagoda_x", "auto") == ("pagoda_x", ["-march=native"])
    detected = cpu_isa.detected_level(cpu_isa.cpu_flags())
    # every level below the detected one builds under its own name with its own flags
    for level in cpu_isa.LEVELS[:cpu_isa.LEVELS.index(detected)]:
        name, flags = cpu_isa.extension_build("pagoda_x", level)
        assert name == f"pagoda_x_{level}" and "-march=native" not in flags
        assert ("-mavx2" in flags) == (level != "generic") and ("-mavx512f" in flags) == (level == "avx512")


def test_auto_dtype_is_bf16_down_to_avx2_and_float32_below(monkeypatch, tmp_path):
    import torch

    from pagoda.engine.engine_args import EngineArgs
    from pagoda.host.dtypes import resolve_dtype
    from tiny_models import write_tiny_checkpoint

    if torch.cuda.is_available():
        pytest.skip("on a GPU auto is bf16 whatever the CPU")
    detected = cpu_isa.detected_level(cpu_isa.cpu_flags())
    if detected == "generic":
        pytest.skip("this CPU has no AVX2")
    # AVX2 without bf16 math: the fused kernels widen bf16 weights in registers, so auto keeps them bf16
    assert resolve_dtype("auto", "avx2") == torch.bfloat16
    # ... unless those kernels are off (torch's bf16 matmul is far slower than fp32 there), or below AVX2
    assert resolve_dtype("auto", "avx2", fused_cpu_ops=False) == torch.float32
    assert resolve_dtype("auto", "generic") == torch.float32
    # native bf16 math does not need the fused kernels
    if detected == "avx512_bf16":
        assert resolve_dtype("auto", "avx512_bf16", fused_cpu_ops=False) == torch.bfloat16
    # through the engine's options, and through their environment variables
    model = str(write_tiny_checkpoint(tmp_path))
    assert EngineArgs(model=model, cpu_isa="avx2").create_engine_config().model.dtype == torch.bfloat16
    assert EngineArgs(model=model, cpu_isa="generic").create_engine_config().model.dtype == torch.float32
    assert EngineArgs(model=model, cpu_isa="avx2",
                      fused_cpu_ops=False).create_engine_config().model.dtype == torch.float32
    monkeypatch.setenv("PAGODA_CPU_ISA", "generic")
    assert EngineArgs(model=model).create_engine_config().model.dtype == torch.float32
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    assert EngineArgs(model=model).create_engine_config().model.dtype == torch.bfloat16


def test_the_levels_an_option_accepts_are_the_levels_there_are():
    from pagoda.host.env import HOST_CHOICES

    assert HOST_CHOICES["cpu_isa"] == ("auto", *cpu_isa.LEVELS)
