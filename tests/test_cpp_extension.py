"""Kernel builds are named by their source and flags, so checkouts sharing torch's cache never swap builds."""

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


def test_the_same_source_in_two_checkouts_builds_under_two_names(tmp_path):
    """torch's build file names the source's path: one name for both would rebuild at every switch between them."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    for checkout in ("one", "two"):
        (tmp_path / checkout / "k.cpp").write_text("int f() { return 1; }\n")
    assert _source_digest(tmp_path / "one" / "k.cpp", ["-O3"]) != _source_digest(tmp_path / "two" / "k.cpp", ["-O3"])


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
