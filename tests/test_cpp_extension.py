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


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    import os
    import time

    from pagoda.host import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory("pagoda_lock_probe", verbose=False)) / "lock"
    lock.touch()
    cpp_extension._clear_stale_lock("pagoda_lock_probe")
    assert lock.exists()  # a build may be running: wait for it as torch does
    old = time.time() - cpp_extension.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removing the build lock .* did not finish"):
        cpp_extension._clear_stale_lock("pagoda_lock_probe")
    assert not lock.exists()
