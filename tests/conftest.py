"""Suite-wide settings that must be in place before any test module imports torch or triton."""

import gc
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
# one compute thread per engine, including the `pagoda serve` processes tests start: the two workers share two
# cores, and the thread count an engine measures when none is set costs each start seconds of bf16 matmuls on an
# AVX2 CPU (3.5 s of a 4 s start of the default model). The tests of that measurement unset it themselves.
os.environ.setdefault("PAGODA_CPU_THREADS", "1")
# engines map their KV cache as blocks are first used, not all at start: on a VM a start's mapping of a 64 MiB
# cache costs some 0.3 s, paid by every engine the suite builds (test_hugepages.py tests the mapping at start)
os.environ.setdefault("PAGODA_KV_CACHE_PREFAULT", "0")


@pytest.fixture(autouse=True)
def host_settings_of_this_test(monkeypatch):
    """Each test starts as a process with no engine alive: an engine an earlier test built (and did not free
    yet) neither shares its thread count with this test's engines nor conflicts with their settings."""
    import weakref

    from pagoda.host import settings as host

    monkeypatch.setattr(host, "_live_engines", weakref.WeakKeyDictionary())


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs, shared by the tests of a module (ranks as Ray actors, replicas on Serve)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


# --- the suite's time and memory: what `make test` prints at its end -------------------------------------------

# Test files whose tests take the most time (each file's setup + call + teardown in the last full run's durations, two
# workers on the Zen 5, scaled by each file's time measured alone since then, longest first; the last four are long
# on an AVX2-only CPU). With pytest-xdist's --dist loadfile a worker takes a whole file at a time, so a long file that
# starts last keeps one worker busy while the other has nothing left: these start first, longest first, every other
# file (each under about 8 s there) after them in its usual order, so the two workers end within about a file of each
# other (the Makefile turns off xdist's own reordering by number of tests per file).
LONG_FILES_FIRST = ("test_ray_cluster.py", "test_tool_calling_clients.py", "test_tensor_parallel.py",
                    "test_server_cli.py", "test_server_responses_tools.py", "test_structured_outputs_speculative.py",
                    "test_moe_bench_compare.py", "test_model_features.py", "test_server_errors.py", "test_models.py",
                    "test_bench_soak.py", "test_bf16_parity.py", "test_bench_workloads.py",
                    "test_server_tool_calling.py", "test_contracts.py", "test_structured_outputs_hostile.py",
                    "test_kv_connector_serve.py", "test_pipeline_parallel.py", "test_cuda_backend_compiles.py",
                    "test_lora_tensor_parallel.py", "test_structured_outputs.py", "test_model_composition.py",
                    "test_server_responses.py", "test_engine.py", "test_spec_decode.py", "test_plugin_guide.py",
                    "test_kv_cache_fp8.py", "test_default_model.py")


def pytest_addoption(parser):
    parser.addoption("--slowest", type=int, default=0, metavar="N",
                     help="at the end, the N slowest tests (setup, call and teardown together) with what each checks")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session):
    """Leave the objects alive now (modules, classes, functions: some 400,000 once torch, transformers and the test
    modules are imported) out of every later collection of reference cycles. A full collection visits every object
    the collector tracks: 0.2-0.3 s of CPU in a worker, and the suite runs hundreds (each engine released, each
    file's end, and Python's own as objects pile up); frozen, the objects the tests made since are all it visits.
    What is frozen is still freed when its last reference goes, only a cycle of frozen objects stays."""
    gc.collect()
    gc.freeze()


def _what_it_checks(item) -> str:
    """A test's docstring's first line, else its name as a sentence (the suite names tests by what they check)."""
    doc = getattr(getattr(item, "function", None), "__doc__", None)
    if doc and doc.strip():
        return doc.strip().splitlines()[0]
    return item.originalname.removeprefix("test_").replace("_", " ") if hasattr(item, "originalname") else item.name


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "setup":
        report.user_properties.append(("checks", _what_it_checks(item)))
    return report


_SLOWEST: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    entry = _SLOWEST.setdefault(report.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0, "checks": ""})
    entry[report.when] += report.duration
    for name, value in report.user_properties:
        if name == "checks":
            entry["checks"] = value


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


_MEMORY = {"peak_gb": 0.0, "files": {}, "after_release_gb": 0.0}


def _release_memory():
    """Hand back to the kernel what a finished test file's engines and servers held: their module fixtures are
    torn down by now, so collect the reference cycles that still hold tensors and trim glibc's heaps (an engine
    tunes malloc to keep up to 1 GB freed memory, per heap, for its own reuse; the next file builds its own)."""
    import ctypes
    import ctypes.util
    import sys

    # FastAPI remembers, in module-level lru_caches, whether each route function is a coroutine: the functions
    # of every app a test file served, and through their closures its engine (half a GB and up), would stay
    # alive for the rest of the worker's run
    fastapi_models = sys.modules.get("fastapi.dependencies.models")
    for name in dir(fastapi_models) if fastapi_models else ():
        cached = getattr(fastapi_models, name)
        if callable(getattr(cached, "cache_clear", None)):
            cached.cache_clear()
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


# a test at whose end the process holds more than RELEASE_ABOVE_GB, and this much more than after the last release
# (engines of its own, a server, a model), has what is no longer referenced collected and trimmed, so the engines of
# a file's tests do not pile up until the file ends (one collection per test would cost more than it gives back)
RELEASE_AFTER_GROWTH_GB = 0.5
RELEASE_ABOVE_GB = 1.5


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    rss = _rss_gb()
    if rss > RELEASE_ABOVE_GB and rss - _MEMORY["after_release_gb"] > RELEASE_AFTER_GROWTH_GB:
        # an engine no longer referenced is still held by its reference cycles until the collector runs
        _release_memory()
        _MEMORY["after_release_gb"] = _rss_gb()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    # after the protocol, not in the teardown: until the teardown hooks have all run the test keeps its fixture
    # values (item.funcargs, every fixture it used directly or not), so a module's engine would still be alive
    if nextitem is None or nextitem.path != item.path:  # the file's last test: its module fixtures are gone
        peak_before = _MEMORY["peak_gb"]
        _MEMORY["peak_gb"] = _peak_rss_gb()
        before = _rss_gb()
        _release_memory()
        # what the file imported and is alive after the collection above stays for the worker's run anyway
        gc.freeze()
        _MEMORY["after_release_gb"] = _rss_gb()
        _MEMORY["files"][item.path.name] = (_MEMORY["peak_gb"] if _MEMORY["peak_gb"] > peak_before else None,
                                            before, _rss_gb())
    return result


def pytest_sessionfinish(session):
    gc.unfreeze()  # the interpreter's last collections at exit see everything again, as extension modules expect
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller prints it
        workeroutput["pagoda_memory"] = {"peak_gb": _peak_rss_gb(), "files": _MEMORY["files"]}


_WORKERS: dict[str, dict] = {}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the controller hears a worker has finished
def pytest_testnodedown(node, error):
    memory = getattr(node, "workeroutput", {}).get("pagoda_memory")
    if memory:
        _WORKERS[node.gateway.id] = memory


MEMORY_BUDGET_GB = 4.0


def _memory_lines() -> list[str]:
    workers = _WORKERS or {"this process": {"peak_gb": _peak_rss_gb(), "files": _MEMORY["files"]}}
    lines = []
    for name, memory in sorted(workers.items()):
        # the files that raised this process's peak, highest first: where its memory went
        raised = sorted(((peak, f) for f, (peak, _, _) in memory["files"].items() if peak), reverse=True)[:3]
        # what stayed held after a file was done and its memory released: a file that leaves much behind leaks
        held, grew, previous = 0.0, [], None
        for f, (_, _, after) in memory["files"].items():
            if previous is not None:
                grew.append((after - previous, f))
            previous = held = after
        grew = sorted(grew, reverse=True)[:3]
        over = f" -- above the {MEMORY_BUDGET_GB:.0f} GB budget" if memory["peak_gb"] > MEMORY_BUDGET_GB else ""
        lines.append(f"{name}: peak RSS {memory['peak_gb']:.2f} GB{over}; peak raised to "
                     + ", ".join(f"{peak:.2f} GB by {f}" for peak, f in raised)
                     + f"; {held:.2f} GB held at the end"
                     + (", most left behind by " + ", ".join(f"{f} ({d * 1024:+.0f} MB)" for d, f in grew)
                        if grew else ""))
    return lines


def pytest_terminal_summary(terminalreporter):
    """Which CPU code paths this run covered: the ISA level pagoda's kernels were built for; with ``--slowest N``
    the N slowest tests and what each checks, and each worker's peak memory."""
    from pagoda.host import cpu_isa

    level = cpu_isa.cpu_isa()
    hint = "" if cpu_isa.is_capped() or level in ("generic", "avx2") else " (make test-avx2 runs the AVX2 path here)"
    terminalreporter.write_line(f"pagoda CPU kernels ran at ISA level: {cpu_isa.describe()}{hint}")
    n = terminalreporter.config.getoption("slowest")
    if not n:
        return
    terminalreporter.write_sep("=", f"{n} slowest tests (setup + call + teardown; setup includes module fixtures)")
    slowest = sorted(_SLOWEST.items(), key=lambda kv: -(kv[1]["setup"] + kv[1]["call"] + kv[1]["teardown"]))[:n]
    for nodeid, t in slowest:
        total = t["setup"] + t["call"] + t["teardown"]
        terminalreporter.write_line(f"{total:7.1f} s (setup {t['setup']:5.1f})  {nodeid}")
        terminalreporter.write_line(f"{'':27}checks: {t['checks']}")
    # a worker takes a whole file at a time: the longest files are those LONG_FILES_FIRST should start first
    files: dict[str, float] = {}
    for nodeid, t in _SLOWEST.items():
        path = nodeid.split("::")[0]
        files[path] = files.get(path, 0.0) + t["setup"] + t["call"] + t["teardown"]
    terminalreporter.write_sep("=", f"{n} longest test files (all their tests)")
    for path, total in sorted(files.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{total:7.1f} s  {path}")
    terminalreporter.write_sep("=", "memory per worker process (RSS)")
    for line in _memory_lines():
        terminalreporter.write_line(line)
