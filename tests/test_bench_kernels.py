"""``pagoda bench kernels`` times the backends that run here and reports achieved bandwidth."""

from __future__ import annotations

import re

import pytest
import torch

from pagoda.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report")
def test_bench_kernels_times_the_torch_backend_on_a_cpu_and_reports_its_bandwidth(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = main(["bench", "kernels", "--backends", "torch,triton,cuda", "--batch-sizes", "2", "--seq-lens", "40",
                 "100", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float32",
                 "--iters", "2", "--warmup", "1", "--cpu-threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"reference bandwidth: \d+ GB/s \(measured CPU copy bandwidth\)", out)
    rows = re.findall(r"^torch\s+2\s+(40|100)\s+([\d.]+)\s+([\d.]+)\s+\d+%", out, re.M)
    assert [r[0] for r in rows] == ["40", "100"]
    assert all(float(ms) > 0 and float(gbps) > 0 for _, ms, gbps in rows)
    assert re.search(r"^triton\s+skipped: .*TRITON_INTERPRET=1", out, re.M)
    assert re.search(r"^cuda\s+skipped: .*CUDA", out, re.M)


def test_bench_kernels_counts_prefill_chunks_as_context_plus_causal_keys():
    from pagoda.plugins.entrypoints.bench.kernels import Workload

    # 3 new tokens after 5 cached ones see 6, 7 and 8 keys
    assert Workload(batch_size=2, seq_len=8, query_len=3).flops(num_heads=1, head_dim=1) == 4 * 21 * 2
    # a decode reads every cached K/V row once: 2 requests x 8 keys x 2 KV heads x 4 dims x (K, V) x 2 bytes
    kv_read = 2 * 8 * 2 * 4 * 2 * 2
    per_token = (3 * 4 * 2 + 2 * 4 * 4) * 2
    assert Workload(2, 8, 1).bytes_moved(num_heads=3, num_kv_heads=2, head_dim=4, element_size=2) == \
        kv_read + 2 * per_token
