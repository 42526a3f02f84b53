"""Kernel sources are built from a copy whose path does not depend on the checkout, so a second checkout of the
same sources reuses the compiled kernels instead of rebuilding them."""

from pagoda.cpp_extension import _stable_source


def test_the_build_copy_is_shared_between_checkouts_and_follows_the_text(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "one" / "k.cpp", tmp_path / "two" / "k.cpp"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text("int f() { return 1; }\n")
    copy = _stable_source("pagoda_k", first)
    assert copy.read_text() == first.read_text() and tmp_path / "cache" in copy.parents
    stamp = copy.stat().st_mtime_ns
    assert _stable_source("pagoda_k", second) == copy and copy.stat().st_mtime_ns == stamp  # untouched: no rebuild
    second.write_text("int f() { return 2; }\n")
    assert _stable_source("pagoda_k", second).read_text() == second.read_text()
