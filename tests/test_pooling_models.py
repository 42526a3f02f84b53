"""Pooling models against sentence-transformers on tiny random checkpoints written with transformers (float32)."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.pooling import PoolingEngine, resolve_task
from pagoda.errors import ConfigError, InvalidRequestError
from pagoda.modeling.pooling import finish_embedding
from pooling_helpers import TEXTS, write_decoder, write_encoder


@pytest.fixture(scope="module")
def sentence_transformers():
    """The reference, imported by the tests that compare with it: its import takes seconds (transformers' models),
    which every process that collects this file would pay."""
    return pytest.importorskip("sentence_transformers")


def _pagoda_embeddings(folder, dimensions=None, **args):
    args.setdefault("dtype", "float32")  # compared with sentence-transformers' float32 to 1e-4
    engine = PoolingEngine(EngineArgs(model=str(folder), **args), resolve_task(str(folder), "auto"))
    vectors = engine.encode([engine.tokenize(t) for t in TEXTS])
    return engine, torch.stack([finish_embedding(v, engine.pooling.normalize, dimensions) for v in vectors])


def _st_embeddings(sentence_transformers, folder, **kwargs):
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, **kwargs).float()


def _assert_same_directions(ours, theirs):
    assert ours.shape == theirs.shape
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.9999
    assert torch.allclose(ours.norm(dim=-1), theirs.norm(dim=-1), atol=1e-4)


@pytest.mark.parametrize("kind, pooling", [("bert", "mean"), ("bert", "cls"), ("roberta", "mean"),
                                           ("roberta", "last")])
def test_encoder_embeddings_match_sentence_transformers(sentence_transformers, tmp_path, kind, pooling):
    folder = write_encoder(tmp_path / "m", kind, pooling)
    engine, ours = _pagoda_embeddings(folder)
    assert engine.task == "embed" and engine.pooling.method == pooling and engine.pooling.normalize
    _assert_same_directions(ours, _st_embeddings(sentence_transformers, folder))
    # texts of different lengths packed in one batch, and runs of texts of one length attending in one call,
    # give what each gives alone
    alone = torch.stack([finish_embedding(engine.run([engine.tokenize(t)])[0], True, None) for t in TEXTS])
    assert torch.nn.functional.cosine_similarity(ours, alone).min().item() >= 0.9999
    twice = torch.stack([finish_embedding(v, True, None) for v in engine.run([engine.tokenize(t)
                                                                                for t in TEXTS + TEXTS[::-1]])])
    assert torch.nn.functional.cosine_similarity(twice, torch.cat([alone, alone.flip(0)])).min().item() >= 0.9999
    from pagoda.modeling.models.bert import PackedLinear, can_pack_linears

    assert isinstance(engine.encoder.layers[0].qkv, PackedLinear) == can_pack_linears(torch.float32)


def test_an_encoder_s_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(sentence_transformers, tmp_path):
    """--dtype auto: bf16 on AVX-512 BF16, float32 on a CPU without bf16 math (its bf16 linears are slow)."""
    from pagoda.host.dtypes import cpu_has_bf16

    folder = write_encoder(tmp_path / "m", "bert", "mean")
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    engine, ours = _pagoda_embeddings(folder, dtype="auto")
    assert engine.encoder.word_embeddings.weight.dtype == want
    # bf16 still points the same way as sentence-transformers' float32, to bf16's precision
    assert torch.nn.functional.cosine_similarity(ours, _st_embeddings(sentence_transformers, folder)).min().item() >= 0.999
    from pagoda.modeling.layers import onednn
    from pagoda.modeling.models.bert import PackedLinear

    # bf16 weights packed for oneDNN where the engine packs bf16 (AVX-512), query/key/value as one product
    packs = want == torch.bfloat16 and onednn.packing_available(EngineArgs(model=str(folder)).host_config())
    assert isinstance(engine.encoder.layers[0].qkv, PackedLinear) == (packs or want == torch.float32)
    if cpu_has_bf16():
        capped = PoolingEngine(EngineArgs(model=str(folder), cpu_isa="avx2"), "embed")
        assert capped.encoder.word_embeddings.weight.dtype == torch.float32


@pytest.mark.parametrize("arch, pooling", [("qwen2", "last"), ("llama", "mean")])
def test_decoder_embeddings_match_sentence_transformers_with_matryoshka_dimensions(sentence_transformers, tmp_path,
                                                                                    arch, pooling):
    folder = write_decoder(tmp_path / "m", arch, pooling)
    args = dict(dtype="float32", kv_cache_memory_bytes=1 << 22)
    engine, ours = _pagoda_embeddings(folder, **args)
    assert engine.task == "embed" and engine.llm_engine is not None
    _assert_same_directions(ours, _st_embeddings(sentence_transformers, folder))
    _, cut = _pagoda_embeddings(folder, dimensions=16, **args)
    # sentence-transformers cuts the normalized vector; pagoda normalizes it again, as OpenAI's dimensions do
    theirs = _st_embeddings(sentence_transformers, folder, truncate_dim=16)
    _assert_same_directions(cut, torch.nn.functional.normalize(theirs, dim=-1))
    assert cut.shape == (len(TEXTS), 16)


@pytest.mark.parametrize("arch, pooling", [("qwen2", "last"), ("llama", "mean")])
def test_a_decoder_embedder_reuses_cached_prefixes_only_for_last_token_pooling(tmp_path, arch, pooling):
    """Inputs sharing a long head: with last-token pooling the later ones compute only what follows the cached
    blocks, and their embeddings are those of an engine without prefix caching; mean pooling computes all."""
    from pagoda.engine.pooling import PoolingInput

    folder = write_decoder(tmp_path / "m", arch, pooling)
    args = dict(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22)
    cached = PoolingEngine(EngineArgs(**args), "embed")
    cold = PoolingEngine(EngineArgs(enable_prefix_caching=False, **args), "embed")
    head = [(7 * i + 3) % 90 + 5 for i in range(3 * cached.block_size + 5)]
    inputs = [PoolingInput(head + tail) for tail in ([11, 12, 13], [21], [31, 32, 33, 34, 35, 36, 37])]
    first = cached.run(inputs[:1])
    later = cached.run(inputs[1:])  # the head's three full blocks are cached now
    theirs = cold.run(inputs)
    assert cached.num_cached_tokens == (2 * 3 * cached.block_size if pooling == "last" else 0)
    assert cold.num_cached_tokens == 0
    ours = torch.stack(first + later)
    assert torch.allclose(ours, torch.stack(theirs), atol=1e-4, rtol=1e-4)
    # the pool holds nothing once a batch is done: every block is free (cached ones can be evicted)
    assert cached.llm_engine.kv_manager.num_free_blocks == cached.llm_engine.num_blocks


def test_cross_encoder_scores_match_sentence_transformers(sentence_transformers, tmp_path):
    folder = write_encoder(tmp_path / "m", "cross")
    pairs = [(TEXTS[3], TEXTS[2]), (TEXTS[3], TEXTS[0]), (TEXTS[1], TEXTS[4]), (TEXTS[0], TEXTS[0])]
    theirs = sentence_transformers.CrossEncoder(str(folder), device="cpu").predict(pairs)
    engine = PoolingEngine(EngineArgs(model=str(folder), dtype="float32"), resolve_task(str(folder), "auto"))
    assert engine.task == "score"
    ours = [float(s) for s in engine.encode([engine.tokenize_pair(a, b) for a, b in pairs])]
    assert ours == pytest.approx([float(s) for s in theirs], abs=1e-5)
    assert len({round(s, 4) for s in ours}) == len(pairs)  # the pairs' scores differ: token types are read


def test_the_task_is_read_from_the_checkpoint_and_a_wrong_one_is_refused(tmp_path):
    encoder = write_encoder(tmp_path / "e", "bert")
    assert resolve_task(str(encoder), "auto") == "embed"
    with pytest.raises(ConfigError, match="cannot generate text; serve it with --task embed"):
        resolve_task(str(encoder), "generate")
    with pytest.raises(ConfigError, match="--task 'rank'"):
        resolve_task(str(encoder), "rank")


def test_an_input_too_long_or_outside_the_vocabulary_is_refused_naming_the_field(tmp_path):
    folder = write_encoder(tmp_path / "m", "bert")
    engine = PoolingEngine(EngineArgs(model=str(folder)), "embed")
    from pagoda.engine.pooling import PoolingInput

    with pytest.raises(InvalidRequestError, match="input: an input has 65 tokens, more than the model's 64"):
        engine.check(PoolingInput([5] * 65), "input")
    with pytest.raises(InvalidRequestError, match=r"token ids \[9999\] are outside the vocabulary"):
        engine.check(PoolingInput([5, 9999]), "input")


def test_serve_flags_choose_the_task_like_vllm(tmp_path):
    import json

    from pagoda.plugins.entrypoints.cli.serve import serving_task

    decoder = tmp_path / "d"
    decoder.mkdir()
    (decoder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert serving_task(str(decoder), "auto", None) == "generate"
    assert serving_task(str(decoder), "auto", "pooling") == "embed"
    assert serving_task(str(decoder), "score", None) == "score"
    (decoder / "modules.json").write_text("[]")
    assert serving_task(str(decoder), "auto", None) == "embed"  # sentence-transformers files: an embedder
    assert serving_task(str(decoder), "auto", "generate") == "generate"
    with pytest.raises(ConfigError, match="--runner generate and --task embed disagree"):
        serving_task(str(decoder), "embed", "generate")
    assert serving_task(str(tmp_path / "absent"), "auto", None) == "generate"  # the default model, a GGUF, ...


def test_a_cancelled_request_is_dropped_before_it_runs_and_the_engine_serves_on(tmp_path):
    import asyncio
    import contextlib

    from pagoda.engine.pooling import AsyncPoolingEngine

    engine = PoolingEngine(EngineArgs(model=str(write_encoder(tmp_path / "bert"))), "embed")
    items = [engine.tokenize(t) for t in TEXTS[:3]]

    async def scenario():
        served = AsyncPoolingEngine(engine)
        served.start(asyncio.get_running_loop())
        with engine.lock:  # the engine's thread blocks on its first batch: the others wait
            first = asyncio.ensure_future(served.encode(items[:1]))
            await asyncio.sleep(0.2)
            gone = asyncio.ensure_future(served.encode(items[1:]))
            await asyncio.sleep(0.05)
            assert served.num_waiting == 2
            gone.cancel()  # a client that went away
            # the cancellation reaches the inputs' futures over a few turns of the loop: all of them before the
            # engine's thread, blocked on the lock, forms its next batch
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            await asyncio.sleep(0.1)
        await first
        after = await served.encode(items[1:])
        await served.shutdown(timeout=5)
        return served, after

    served, after = asyncio.run(scenario())
    assert served.stats.finished_by_reason == {"stop": 3, "abort": 2}
    assert served.num_waiting == 0 and served.is_healthy is False  # shut down, not dead
    assert served.dead_reason is None
    for ours, alone in zip(after, engine.encode(items[1:])):
        assert torch.equal(ours, alone)
