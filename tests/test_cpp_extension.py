"""Kernel builds are named by their text (source, headers, flags, torch), so checkouts sharing torch's cache share
the builds of the same text and never swap builds of different texts."""

from pathlib import Path

import pytest

from pagoda.host.cpp_extension import _source_digest


def test_a_kernel_builds_name_changes_with_its_source_and_its_flags(tmp_path):
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 2; }\n")
    assert _source_digest(a, ["-O3"]) == _source_digest(a, ["-O3"])
    assert _source_digest(a, ["-O3"]) != _source_digest(b, ["-O3"])
    assert _source_digest(a, ["-O3"]) != _source_digest(a, ["-O3", "-mavx2"])


def test_a_kernel_builds_name_changes_with_the_shared_headers_it_may_include(tmp_path, monkeypatch):
    """An edited pagoda_torch.h or pagoda_float.h builds every kernel anew instead of importing a build of the old."""
    from pagoda.host import cpp_extension

    source = tmp_path / "k.cpp"
    source.write_text('#include "pagoda_float.h"\n')
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "pagoda_float.h").write_text("inline float to_f(float x) { return x; }\n")
    monkeypatch.setattr(cpp_extension, "KERNEL_INCLUDE_DIR", headers)
    before = _source_digest(source, ["-O3"])
    (headers / "pagoda_float.h").write_text("inline float to_f(float x) { return 2 * x; }\n")
    assert _source_digest(source, ["-O3"]) != before


def test_a_kernel_builds_name_changes_with_a_header_beside_its_source(tmp_path):
    """An edited csrc/cpu_softmax.h (included by the attention kernels from their own folder) builds them anew."""
    source = tmp_path / "k.cpp"
    source.write_text('#include "csrc/h.h"\n')
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "h.h").write_text("inline int g() { return 1; }\n")
    before = _source_digest(source, ["-O3"])
    (tmp_path / "csrc" / "h.h").write_text("inline int g() { return 2; }\n")
    assert _source_digest(source, ["-O3"]) != before


PROBE = ('#include <pybind11/pybind11.h>\nint answer() { return 42; }\n'
         'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }\n')


def test_a_second_checkout_imports_the_build_of_the_same_text_instead_of_compiling_it(tmp_path, monkeypatch):
    """A fresh clone (or another worktree) compiles no kernel that a checkout on this machine built from the same
    text: torch's build file names the source's path, so its loader alone would compile it again for each."""
    import os
    import subprocess
    import sys

    import torch.utils.cpp_extension as torch_extension

    from pagoda.host import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    one, two = tmp_path / "one" / "k.cpp", tmp_path / "two" / "k.cpp"
    for source in (one, two):
        source.parent.mkdir()
        source.write_text(PROBE)
    os.utime(one, (1, 1))  # the second clone's files are newer than the first one's build
    assert _source_digest(one, ["-O0"]) == _source_digest(two, ["-O0"])
    assert cpp_extension._load.__wrapped__("pagoda_probe", one, ("-O0",), "auto", False).answer() == 42

    def compile_again(**kwargs):
        raise AssertionError(f"compiled {kwargs['sources']} again")

    monkeypatch.setattr(torch_extension, "load", compile_again)
    assert cpp_extension._load.__wrapped__("pagoda_probe", two, ("-O0",), "auto", False).answer() == 42
    # a process that only imports builds never imports torch's loader (it imports setuptools: some 0.4 s of CPU
    # at every engine's start)
    fresh = subprocess.run([sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
                            "from pagoda.host.cpp_extension import _load\n"
                            f"print(_load('pagoda_probe', Path({str(two)!r}), ('-O0',), 'auto', False).answer(), "
                            "'torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)"],
                           capture_output=True, text=True, timeout=300)
    assert fresh.stdout.split() == ["42", "False", "False"], fresh.stdout + fresh.stderr[-3000:]
    two.write_text(PROBE.replace("42", "43"))  # another text: its own build, which the loader is asked for
    with pytest.raises(AssertionError, match="compiled .*two/k.cpp"):
        cpp_extension._load.__wrapped__("pagoda_probe", two, ("-O0",), "auto", False)


def test_a_build_s_directory_is_the_one_torch_s_loader_builds_it_in(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    from pagoda.host.cpp_extension import build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    assert build_directory("pagoda_k") == Path(_get_build_directory("pagoda_k", verbose=False))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # torch's cache folder, made here
    assert build_directory("pagoda_k") == Path(_get_build_directory("pagoda_k", verbose=False))
    assert build_directory("pagoda_k").is_relative_to(tmp_path / "cache")


def test_a_live_build_is_waited_for_and_the_lock_of_a_killed_one_removed(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import threading

    from pagoda.host import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    torch_lock = Path(_get_build_directory("pagoda_lock_probe", verbose=False)) / "lock"
    # another process building the kernel: it holds pagoda's builder lock and torch's build lock exists
    builder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from pagoda.host.cpp_extension import _one_builder\n"
         "with _one_builder('pagoda_lock_probe'):\n"
         f"    open({str(torch_lock)!r}, 'w').close()\n"
         "    print('building', flush=True)\n"
         "    time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    try:
        assert builder.stdout.readline().strip() == "building"
        entered = threading.Event()
        seen: list[bool] = []

        def build_here():
            with cpp_extension._one_builder("pagoda_lock_probe"):
                seen.append(torch_lock.exists())
                entered.set()

        with pytest.warns(RuntimeWarning, match="removing the build lock .* did not finish"):
            waiter = threading.Thread(target=build_here)
            waiter.start()
            assert not entered.wait(1.0)  # the build is alive: wait for it, as torch does
            assert torch_lock.exists()
            builder.kill()  # killed mid-build: its torch lock stays behind, the OS lets go of pagoda's
            assert entered.wait(30)
            waiter.join()
        assert seen == [False]  # the dead build's torch lock was gone before this process went on
    finally:
        builder.kill()
        builder.wait()
