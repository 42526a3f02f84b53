"""Suite-wide settings that must be in place before any test module imports torch or triton."""

import os
import shutil

import pytest

# Triton decides at import time whether kernels are compiled or interpreted, and the plugin
# manager imports the triton backend as soon as any test builds an engine. Without a GPU the
# kernels can only run interpreted, so say so before anything imports triton; the tests of the
# "no GPU, no interpreter" path unset it themselves.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# sleeping, not spinning, OpenMP threads (the pagoda command chooses a policy itself; importing pagoda does not)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def host_settings_of_this_test(monkeypatch):
    """Each test starts as a process with no engine alive: an engine an earlier test built (and did not free
    yet) neither shares its thread count with this test's engines nor conflicts with their settings."""
    import weakref

    from pagoda.host import settings as host

    monkeypatch.setattr(host, "_live_engines", weakref.WeakKeyDictionary())


def pytest_terminal_summary(terminalreporter):
    """Which CPU code paths this run covered: the ISA level pagoda's kernels were built for."""
    from pagoda.host import cpu_isa

    level = cpu_isa.cpu_isa()
    hint = "" if cpu_isa.is_capped() or level in ("generic", "avx2") else " (make test-avx2 runs the AVX2 path here)"
    terminalreporter.write_line(f"pagoda CPU kernels ran at ISA level: {cpu_isa.describe()}{hint}")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs, shared by the tests of a module that run ranks as Ray actors."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
