"""One layer's attention over one fresh 300-token prompt of the default model's shape (9 query and 3 KV heads of
64, bf16, 2 threads), through the C++ prefill kernel and through the torch backend's masked attention, for the two
kinds of layer that took the torch path before the kernel served them: Gemma 2's soft-capped scores and gpt-oss's
window with sinks. Best of 30 alternated runs each:

    python contrib/model-speed/shaped_prefill.py
"""

import time
from types import SimpleNamespace

import torch

from pagoda.plugins.attention.cpu_backend import load_prefill_kernel
from pagoda.plugins.attention.torch_backend import TorchAttentionBackend

torch.set_num_threads(2)
kern = load_prefill_kernel()
mc = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
ref = TorchAttentionBackend(mc, SimpleNamespace(block_size=16))
n = 300
g = torch.Generator().manual_seed(0)
q = torch.randn(n, 9, 64, generator=g).to(torch.bfloat16)
k = torch.randn(n, 3, 64, generator=g).to(torch.bfloat16)
v = torch.randn(n, 3, 64, generator=g).to(torch.bfloat16)
sinks = torch.randn(9, generator=g)
for name, window, softcap, sk in (("gemma2 soft-cap 50", None, 50.0, None), ("gpt-oss window 128 + sinks", 128, None, sinks)):
    layer = SimpleNamespace(scale=0.125, sliding_window=window, logit_softcap=softcap, sinks=sk)
    out = torch.empty_like(q)

    def run_kernel():
        kern.prefill_attention(q, k, v, out, [0, n], 0.125, window=window or 0, softcap=softcap or 0.0, sinks=sk)

    def run_torch():
        ref._attend_fresh(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), layer, window, False)

    best = {"kernel": 1e9, "torch": 1e9}
    for _ in range(30):
        for label, fn in (("kernel", run_kernel), ("torch", run_torch)):
            t = time.perf_counter(); fn(); best[label] = min(best[label], time.perf_counter() - t)
    print(f"{name}: one 300-token prompt, one layer: kernel {best['kernel'] * 1e3:.2f} ms, "
          f"torch path {best['torch'] * 1e3:.2f} ms, {best['torch'] / best['kernel']:.1f}x")
