"""Kernel builds are named by their source and flags, so checkouts sharing torch's cache never swap builds."""

from pagoda.host.cpp_extension import _source_digest


def test_a_kernel_builds_name_changes_with_its_source_and_its_flags(tmp_path):
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 2; }\n")
    assert _source_digest(a, ["-O3"]) == _source_digest(a, ["-O3"])
    assert _source_digest(a, ["-O3"]) != _source_digest(b, ["-O3"])
    assert _source_digest(a, ["-O3"]) != _source_digest(a, ["-O3", "-mavx2"])
