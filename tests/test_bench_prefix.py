"""``pagoda bench prefix``: W2 with and without prefix caching, on a small shape of the workload."""

from __future__ import annotations

import re

import pytest

from pagoda.cli import main
from pagoda.modeling.default_model import ensure_default_model


@pytest.mark.slow
def test_bench_prefix_reports_ttft_total_time_and_the_hit_rate(capsys):
    ensure_default_model()
    code = main(["bench", "prefix", "--num-requests", "4", "--prefix-len", "64", "--suffix-len", "8",
                 "--output-len", "3", "--dtype", "float32", "--cpu-threads", "1", "--kv-cache-memory-bytes",
                 str(16 << 20), "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"with prefix caching\s*: mean TTFT\s+[\d.]+ s\s+total\s+[\d.]+ s", out)
    assert re.search(r"without prefix caching: mean TTFT\s+[\d.]+ s\s+total\s+[\d.]+ s", out)
    # 72-token prompts: the 3 later requests reuse the prefix's 4 full blocks (64 tokens) each
    assert "prefix cache hit rate: 66.7% (192 of 288 prompt tokens)" in out
    assert re.search(r"ratio without / with prefix caching: mean TTFT [\d.]+x, total time [\d.]+x"
                     r"   \(CPU time: mean TTFT [\d.]+x", out)
