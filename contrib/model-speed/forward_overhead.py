"""What a decode step's model forward costs beyond its arithmetic, on one thread.

1. The default model's forward (30 layers; no LM head, no sampling) over 1, 4, 8 and 16 decode rows of 128-token
   contexts: wall and process CPU time, medians of REPS steps.
2. The same over a narrow clone of it (the same 30 layers, heads, kernels and code path, with a hidden size and an
   MLP of 64): its arithmetic is almost nothing, so its time is the step's fixed cost (Python, kernel calls'
   dispatch, allocations).
3. One layer of the clone alone at 8 rows, again and again: its forward against the bare sequence of the kernel
   calls it makes (the floor); the difference is the layer's own Python.

    python contrib/model-speed/forward_overhead.py [REPS]
"""

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagoda import LLM
from pagoda.execution.model_runner import FlatBatch
from pagoda.modeling.default_model import ensure_default_model

ROWS = (1, 4, 8, 16)
CONTEXT = 128


def narrow_clone(directory: Path) -> str:
    """The default model's config with hidden and intermediate sizes of 64, random weights, its tokenizer."""
    source = ensure_default_model()
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=64)
    (directory / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    g = torch.Generator().manual_seed(0)
    h, d, heads, kv_heads = 64, cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv_heads * d, h),
              "self_attn.v_proj": (kv_heads * d, h), "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (64, h),
              "mlp.up_proj": (64, h), "mlp.down_proj": (h, 64)}
    tensors = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g) * 0.05,
               "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{name}.weight"] = torch.ones(h)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def decode_batch(num_rows: int, block_size: int) -> FlatBatch:
    """``num_rows`` requests each decoding its token at position CONTEXT, in blocks of their own."""
    per = CONTEXT // block_size + 1
    tables = [list(range(1 + r * per, 1 + (r + 1) * per)) for r in range(num_rows)]
    return FlatBatch([[1000 + r] for r in range(num_rows)], [CONTEXT] * num_rows, tables, block_size,
                     [CONTEXT] * num_rows)


def time_steps(llm: LLM, label: str, reps: int) -> None:
    runner = llm.engine.runner
    for n in ROWS:
        batch = decode_batch(n, runner.block_size)
        metadata = runner.backend.build_metadata(batch.attention)
        walls, cpus = [], []
        for i in range(reps + 5):  # the first five warm up
            c, w = time.process_time(), time.perf_counter()
            runner.forward(batch, metadata=metadata)
            if i >= 5:
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
        print(f"{label} {n:2d} rows: wall {statistics.median(walls) * 1e3:6.2f} ms, CPU "
              f"{statistics.median(cpus) * 1e3:6.2f} ms", flush=True)


def layer_against_floor(llm: LLM, num_rows: int = 8, calls: int = 3000) -> None:
    """Layer 0 of the narrow clone (the default layout: fused RoPE, cpu attention, packed bf16 linears)."""
    runner, model = llm.engine.runner, llm.engine.model
    batch = decode_batch(num_rows, runner.block_size)
    md = runner.backend.build_metadata(batch.attention)
    runner.forward(batch, metadata=md)  # the model picks how its layers call their modules
    layer, cache = model.layers[0], runner.kv_caches[0]
    ops, attention = model.kernels.ops, runner.backend.kernels
    hidden = model.spec.hidden_size
    x, residual = (torch.randn(num_rows, hidden).to(torch.bfloat16) for _ in range(2))
    ropes = {id(r): r.at(torch.full((num_rows,), CONTEXT)) for r in model.rotaries}
    rope = next(iter(ropes.values()))
    linear = torch.ops.mkldnn._linear_pointwise.default
    w_qkv, w_o, w_gate_up, w_down = (m.weight for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                        layer.down_proj))
    heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    eps = layer.input_layernorm.eps

    def floor():
        ops.add_rms_norm(x, residual, layer.input_layernorm.weight, eps, x)
        qkv = linear(x, w_qkv, None, "none", [], "")
        ops.rotary_(qkv, rope.rotary.cos_cache, rope.rotary.sin_cache, rope.positions, heads + kv_heads, d)
        q, k, v = qkv.view(num_rows, -1, d).split_with_sizes((heads, kv_heads, kv_heads), 1)
        attention.write_kv(cache, k, v, md.slot_mapping)
        out = attention.paged_attention(q, cache, md.block_tables, md.token_req, md.token_len, layer.attn.scale,
                                        1.0, 1.0)
        a = linear(out.view(num_rows, -1), w_o, None, "none", [], "")
        ops.add_rms_norm(a, residual, layer.post_attention_layernorm.weight, eps, a)
        return linear(ops.silu_and_mul(linear(a, w_gate_up, None, "none", [], "")), w_down, None, "none", [], "")

    def whole_layer():
        return layer(x, residual, ropes, cache, md)

    for label, fn in (("kernel calls only", floor), ("the layer's forward", whole_layer)) * 2:
        for _ in range(100):
            fn()
        times = []
        for _ in range(7):
            c = time.process_time()
            for _ in range(calls):
                fn()
            times.append((time.process_time() - c) / calls * 1e6)
        print(f"one layer, {num_rows} rows, {label}: {statistics.median(times):6.1f} us CPU (median of 7 x {calls})")


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    options = dict(cpu_threads=1, max_model_len=512, num_gpu_blocks_override=400)
    llm = LLM(**options)
    time_steps(llm, "default model,", reps)
    del llm
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=narrow_clone(Path(tmp)), **options)
        time_steps(llm, "narrow clone, ", reps)
        layer_against_floor(llm)


if __name__ == "__main__":
    main()
