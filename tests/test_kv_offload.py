"""The prefix cache's offload tiers with real models: blocks evicted from a small KV pool come back from RAM
and disk with the tokens of a run without them; a damaged block file is detected and recomputed, never used;
a directory kept across restarts gives the next engine its hits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.cli import add_engine_args, engine_args_from
from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.metrics import PrometheusExporter
from pagoda.errors import ConfigError
from pagoda.modeling.default_model import ensure_default_model
from tiny_models import write_tiny_llama

rng = random.Random(5)
# four 48-token prefixes (3 blocks each) with distinct tails, twice: a 12-block pool cannot keep all four,
# so the second pass finds its prefixes evicted, in a tier, or nowhere
PREFIXES = [[rng.randrange(1000, 30000) for _ in range(48)] for _ in range(4)]
PROMPTS = [p + [rng.randrange(1000, 30000) for _ in range(5)] for p in PREFIXES] * 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL_POOL = dict(num_gpu_blocks_override=12, max_num_seqs=2, max_model_len=256, cpu_threads=1)


def generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    return str(path)


def tiny(model: str, **options) -> LLM:
    return LLM(model=model, dtype="float32", **{**SMALL_POOL, **options})


@pytest.fixture(scope="module")
def tiny_reference(tiny_model) -> list[list[int]]:
    return generate(tiny(tiny_model))


def test_default_model_greedy_tokens_are_identical_with_offload_and_hits_come_from_ram_and_disk(tmp_path):
    ensure_default_model()
    # bf16 in the batch-invariant mode: a block brought back from a tier gives the bits of computing it again
    # (docs/batch_invariance.md)
    bf16 = dict(dtype="bfloat16", batch_invariant=True, **SMALL_POOL)
    plain = LLM(**bf16)
    reference = generate(plain)
    # a bf16 block of the default model is 360 KiB: RAM for 2 blocks, disk for 14
    llm = LLM(kv_offload_ram=0.00075, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.005, **bf16)
    assert generate(llm) == reference
    kv = llm.engine.kv_manager
    stats = kv.tiers.stats
    assert stats.ram.hits > 0 and stats.disk.hits > 0, stats
    assert kv.stats.hits >= plain.engine.kv_manager.stats.hits + 16 * (stats.ram.hits + stats.disk.hits)
    assert stats.ram.loaded_bytes == stats.ram.hits * 368640 and stats.disk.corrupt == 0
    text = PrometheusExporter.for_engine(llm.engine).render().decode()
    for tier in ("ram", "disk"):
        hits = getattr(stats, tier).hits
        assert f'pagoda:kv_offload_hits_total{{model_name="SmolLM2-135M-Instruct",tier="{tier}"}} {hits}.0' in text
    assert 'pagoda:kv_offload_blocks{model_name="SmolLM2-135M-Instruct",tier="disk"}' in text


def test_a_restarted_engine_gets_hits_from_the_blocks_left_on_disk(tiny_model, tiny_reference, tmp_path):
    first = tiny(tiny_model, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    assert generate(first) == tiny_reference
    first.engine.shutdown()  # writes the prefix blocks still in the pool to disk
    files = list(tmp_path.glob("pagoda-kv-*/*.kv"))
    # every full block of the four prefixes (3 each) and of the prompts' tails (none: 5 tokens)
    assert len(files) == first.engine.kv_manager.tiers.stats.num_disk_blocks == 12
    again = tiny(tiny_model, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    tiers = again.engine.kv_manager.tiers
    assert tiers.stats.num_disk_blocks == len(files)
    # the first pass already finds every prefix on disk
    outs = again.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny_reference[:4]
    assert tiers.stats.disk.hits == 12 and [o.num_cached_tokens for o in outs] == [48] * 4
    # another configuration (block size) never reads these files: its own directory, no hits
    other = tiny(tiny_model, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01, block_size=32)
    assert other.engine.kv_manager.tiers.stats.num_disk_blocks == 0
    assert len(list(tmp_path.glob("pagoda-kv-*"))) == 2


def damage(files: list[Path]) -> None:
    """Half the files get NaN bytes in the middle of their K/V, the other half lose their second half."""
    for i, path in enumerate(sorted(files)):
        data = bytearray(path.read_bytes())
        if i % 2:
            path.write_bytes(data[:len(data) // 2])
        else:
            middle = len(data) // 2
            data[middle:middle + 64] = b"\xff" * 64  # float32 NaNs: used, they would wreck the tokens
            path.write_bytes(bytes(data))


def test_corrupt_and_truncated_block_files_are_detected_and_recomputed(tiny_model, tiny_reference, tmp_path):
    first = tiny(tiny_model, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    generate(first)
    first.engine.shutdown()
    files = list(tmp_path.glob("pagoda-kv-*/*.kv"))
    damage(files)
    damaged = {p.name: p.read_bytes() for p in files}
    llm = tiny(tiny_model, kv_offload_disk=str(tmp_path), kv_offload_disk_size=0.01)
    assert generate(llm) == tiny_reference
    stats = llm.engine.kv_manager.tiers.stats
    assert stats.disk.corrupt > 0 and stats.disk.misses >= stats.disk.corrupt
    # every damaged file that was read is gone or was written again whole
    left = {p.name: p.read_bytes() for p in tmp_path.glob("pagoda-kv-*/*.kv")}
    assert sum(1 for name, data in damaged.items() if left.get(name) == data) <= len(damaged) - stats.disk.corrupt


def test_tensor_parallel_ranks_keep_their_own_block_files_and_recompute_what_one_rank_finds_corrupt(
        tiny_model, tiny_reference, tmp_path):
    options = dict(tensor_parallel_size=2, kv_offload_ram=0.0001, kv_offload_disk=str(tmp_path),
                   kv_offload_disk_size=0.01)
    llm = tiny(tiny_model, **options)
    try:
        assert generate(llm) == tiny_reference
        stats = llm.engine.kv_manager.tiers.stats
        assert stats.ram.hits + stats.disk.hits > 0, stats
    finally:
        llm.engine.shutdown()
    rank_dirs = sorted(tmp_path.glob("pagoda-kv-*"))
    assert len(rank_dirs) == 2 and all(list(d.glob("*.kv")) for d in rank_dirs)
    # one rank's files damaged, the other's whole: both ranks must still recompute the same blocks
    damage(list(rank_dirs[0].glob("*.kv")))
    llm = tiny(tiny_model, **options)
    try:
        assert generate(llm) == tiny_reference
        assert llm.engine.kv_manager.tiers.stats.disk.corrupt > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("options,message", [
    (dict(kv_offload_disk="/nonexistent/pagoda-kv", kv_offload_disk_size=1), "not an existing directory"),
    (dict(kv_offload_disk="/proc", kv_offload_disk_size=1), "not writable"),
    (dict(kv_offload_disk="{tmp}"), "needs a size limit: add --kv-offload-disk-size"),
    (dict(kv_offload_disk_size=2), "needs a directory: add --kv-offload-disk"),
    (dict(kv_offload_ram=-1), "kv_offload_ram=-1"),
    (dict(kv_offload_disk="{tmp}", kv_offload_disk_size=-0.5), "kv_offload_disk_size=-0.5"),
    (dict(kv_offload_ram=1, enable_prefix_caching=False), "need prefix caching"),
])
def test_bad_offload_flags_say_what_is_wrong(options, message, tmp_path):
    options = {k: str(tmp_path) if v == "{tmp}" else v for k, v in options.items()}
    with pytest.raises(ConfigError, match=message):
        EngineArgs.build(**options).create_engine_config()


def test_a_tier_too_small_for_one_block_is_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="--kv-offload-ram gives 1 bytes, less than one KV block"):
        tiny(tiny_model, kv_offload_ram=1e-9)


def test_the_offload_flags_reach_the_engine_options(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-offload-ram", "0.5", "--kv-offload-disk", str(tmp_path),
                            "--kv-offload-disk-size", "2"])
    cache = engine_args_from(ns).create_engine_config().cache
    assert cache.kv_offload_ram_bytes == 1 << 29 and cache.kv_offload_disk_bytes == 2 << 30
    assert cache.kv_offload_disk_dir == str(tmp_path.resolve())
