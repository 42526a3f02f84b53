"""The benchmark workloads are drawn exactly as docs/benchmarks.md says, and the bench commands run (by the
``pagoda`` entry point in this process: their output and exit status as a subprocess's)."""

from serve_process import run_pagoda_here

from pagoda.plugins.entrypoints.bench.workloads import latency_1, random_64, shared_prefix

SMOLLM2_VOCAB = 49152
SMOLLM2_SPECIAL = {0, 1, 2}


def test_random_64_matches_the_published_token_counts():
    requests = random_64(SMOLLM2_VOCAB, SMOLLM2_SPECIAL)
    prompt = [len(r.prompt_token_ids) for r in requests]
    output = [r.output_len for r in requests]
    assert len(requests) == 64
    assert sum(prompt) == 9637 and max(prompt) == 512
    assert sum(output) == 5862 and max(output) == 256
    assert all(100 <= t < SMOLLM2_VOCAB for r in requests for t in r.prompt_token_ids)


def test_latency_and_shared_prefix_workloads_have_their_shapes():
    req = latency_1(SMOLLM2_VOCAB, SMOLLM2_SPECIAL)
    assert len(req.prompt_token_ids) == 128 and req.output_len == 128
    shared = shared_prefix(SMOLLM2_VOCAB, SMOLLM2_SPECIAL)
    assert len(shared) == 64
    assert all(r.prompt_token_ids[:1024] == shared[0].prompt_token_ids[:1024] for r in shared)
    assert len({tuple(r.prompt_token_ids[1024:]) for r in shared}) == 64


def test_bench_throughput_prints_pagoda_hf_ratio_kv_waste_and_profile(tmp_path, capsys):
    """``pagoda bench throughput`` runs its HF baseline in a fresh process that never imports pagoda (the command
    refuses a baseline whose process did: its timings would carry pagoda's malloc and OpenMP settings)."""
    from tiny_models import write_tiny_llama

    # a 2-layer model with random weights in a real checkpoint: the command, the roofline over the model's own
    # shapes, the profile and the HF baseline (which loads the same files) run as on the default model. In
    # float32, as the HF baseline: the roofline's bf16 GEMMs (its LM head at 2048 rows) take over a minute on an AVX2
    # CPU without bf16 instructions (the bf16 roofline is measured in the quantized-model test below). The command
    # runs by its entry point in this process (a process start costs seconds of imports); its baseline does not
    write_tiny_llama(tmp_path)
    out = run_pagoda_here(capsys, "bench", "throughput", "--model", str(tmp_path), "--num-requests", "4",
                          "--hf-batch-size", "2", "--hf-batches", "1", "--profile", "--roofline", "--cpu-threads", "1",
                          "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20))
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "threads: 1" in text and "CPU kernels built for: " in text
    assert "pagoda:" in text and "output tok/s" in text
    assert "KV cache at peak" in text and "waste" in text
    assert "profile: 8 decode steps" in text and "matmuls" in text and "attention" in text
    assert "of the roofline" in text
    assert "in a fresh process" in text and "ratio (output tok/s): pagoda / HF =" in text


def test_the_roofline_of_a_quantized_model_uses_dense_gemms_of_its_shapes(tmp_path):
    from pagoda.engine.llm import LLM
    from pagoda.plugins.entrypoints.bench.roofline import measure_roofline
    from tiny_models import write_tiny_checkpoint

    llm = LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", dtype="bfloat16", quantization="fp8",
              kv_cache_memory_bytes=1 << 22, cpu_threads=1)
    model = llm.engine.model
    from pagoda.modeling.layers.linear import Linear
    dense = sum(m.in_features * m.out_features for m in model.layers[0].modules() if isinstance(m, Linear))
    roofline = measure_roofline(model, len(model.layers), rounds=1)  # fp8 weights: no bf16 x fp8 matmul is attempted
    assert roofline.flops_per_token == 2 * dense * len(model.layers)
    assert all(rate > 0 for rate in roofline.seconds_per_flop.values())
    assert all(rate > 0 for rate in roofline.head_seconds_per_flop.values())
    assert roofline.step_seconds(64, 64) > roofline.step_seconds(64, 0) > 0


def test_the_benchmark_header_names_each_kernels_isa_path(tmp_path):
    from pagoda import LLM
    from pagoda.plugins.entrypoints.bench.throughput import kernel_isa_paths
    from tiny_models import write_tiny_checkpoint

    llm = LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", dtype="bfloat16", attention_backend="cpu",
              kv_cache_memory_bytes=8 << 20, cpu_threads=1)
    paths = kernel_isa_paths(llm)
    assert set(paths) == {"decode attention", "prefill attention", "rmsnorm/silu/rope", "dense linear"}
    assert all(paths.values())


def test_bench_latency_profile_shows_the_grammar_mask_under_a_json_schema_with_speculation(tmp_path, capsys):
    import json
    import re

    from tiny_models import write_tiny_llama

    (tmp_path / "model").mkdir()
    write_tiny_llama(tmp_path / "model")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    out = run_pagoda_here(capsys, "bench", "latency", "--model", str(tmp_path / "model"), "--prompt-len", "16",
                          "--output-len", "24", "--repeats", "1", "--no-baseline", "--profile", "--json-schema",
                          str(schema), "--cpu-threads", "1",
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert out.returncode == 0, out.stderr[-2000:]
    assert "JSON schema on every request" in out.stdout and "under a JSON schema" in out.stdout
    mask = re.search(r"grammar mask \(fill \+ apply\)\s+([0-9.]+) ms", out.stdout)
    assert mask and float(mask.group(1)) > 0, out.stdout
