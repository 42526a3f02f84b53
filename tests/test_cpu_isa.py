"""The CPU's ISA level is read from its flags and can be capped, so one machine tests every kernel path."""

import pytest

from pagoda import cpu_isa

ZEN1 = frozenset("fpu sse4_2 avx avx2 fma f16c bmi2".split())
SKYLAKE_SP = ZEN1 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN4 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni"}


@pytest.mark.parametrize("flags, level", [(frozenset(), "generic"), (ZEN1 - {"f16c"}, "generic"), (ZEN1, "avx2"),
                                          (SKYLAKE_SP, "avx512"), (ZEN4, "avx512_bf16"),
                                          (ZEN1 | {"avx512_bf16"}, "avx2")])
def test_the_level_is_the_highest_whose_flags_and_every_lower_levels_are_present(flags, level):
    assert cpu_isa.detected_level(flags) == level


def test_a_cap_lowers_the_level_but_never_raises_it(monkeypatch):
    detected = cpu_isa.detected_level(cpu_isa.cpu_flags())
    monkeypatch.setenv("PAGODA_CPU_ISA", "auto")
    assert cpu_isa.cpu_isa() == detected and not cpu_isa.is_capped()
    monkeypatch.setenv("PAGODA_CPU_ISA", "generic")
    assert cpu_isa.cpu_isa() == "generic"
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx512_bf16")
    assert cpu_isa.cpu_isa() == detected


def test_an_unknown_cap_names_the_levels(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="PAGODA_CPU_ISA='avx1024'.*auto or one of generic, avx2, avx512"):
        cpu_isa.cpu_isa()


def test_a_capped_kernel_build_has_its_own_name_and_only_its_levels_flags(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_ISA", "auto")
    assert cpu_isa.extension_build("pagoda_x") == ("pagoda_x", ["-march=native"])
    detected = cpu_isa.detected_level(cpu_isa.cpu_flags())
    # every level below the detected one builds under its own name with its own flags
    for level in cpu_isa.LEVELS[:cpu_isa.LEVELS.index(detected)]:
        monkeypatch.setenv("PAGODA_CPU_ISA", level)
        name, flags = cpu_isa.extension_build("pagoda_x")
        assert name == f"pagoda_x_{level}" and "-march=native" not in flags
        assert ("-mavx2" in flags) == (level != "generic") and ("-mavx512f" in flags) == (level == "avx512")


def test_auto_dtype_is_float32_when_the_cap_takes_bf16_math_away(monkeypatch):
    import torch

    from pagoda.config import resolve_dtype

    if torch.cuda.is_available():
        pytest.skip("on a GPU auto is bf16 whatever the CPU")
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    assert resolve_dtype("auto") == torch.float32
