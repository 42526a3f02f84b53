"""pagoda_parallel.h's two-phase region (the MoE kernels' gate/up then down projections in one fork and join):
an item that throws reaches the caller as an error instead of leaving the other threads waiting for a first
phase that can no longer finish."""

import subprocess
import sys
import textwrap

SOURCE = textwrap.dedent("""
    #include <pybind11/pybind11.h>
    #include <stdexcept>
    #include <vector>
    #include "pagoda_parallel.h"

    // both phases' items; the first phase's item `throw_at` (if any) throws; returns how many items ran
    int64_t run(int64_t n1, int64_t n2, int64_t throw_at) {
      std::vector<int> ran(n1 + n2, 0);
      pagoda::parallel_two_phases(n1, [&](int64_t i) {
        if (i == throw_at) throw std::runtime_error("item failed");
        ran[i] = 1;
      }, n2, [&](int64_t j) { ran[n1 + j] = 1; });
      int64_t count = 0;
      for (int r : ran) count += r;
      return count;
    }

    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
      m.def("run", &run, pybind11::call_guard<pybind11::gil_scoped_release>());
    }
""")

CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from pagoda.host.cpp_extension import load_cpu_extension
    torch.set_num_threads(2)
    ops = load_cpu_extension("pagoda_test_two_phases", Path(sys.argv[1]))
    assert ops.run(3, 9, -1) == 12, "every item of both phases runs"
    for n1, n2, throw_at in ((1, 8, 0), (4, 8, 3), (2, 1, 0)):
        try:
            ops.run(n1, n2, throw_at)
        except RuntimeError as e:
            assert "item failed" in str(e), e
        else:
            raise AssertionError("the failed item's error was lost")
    print("ok")
""")


def test_an_item_that_throws_ends_the_region_with_its_error_instead_of_hanging(tmp_path):
    source = tmp_path / "two_phases.cpp"
    source.write_text(SOURCE)
    # a child process: a region that hangs must fail this test after the timeout, not stop the suite
    done = subprocess.run([sys.executable, "-c", CHILD, str(source)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
