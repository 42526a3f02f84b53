"""The offline API of pooling models, as vLLM's: ``LLM(model, task="embed")`` (or ``runner="pooling"``) and its
``embed``, ``score`` and ``encode``, against sentence-transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidRequestError
from pooling_helpers import TEXTS, write_encoder


@pytest.fixture(scope="module")
def sentence_transformers():
    return pytest.importorskip("sentence_transformers")


def test_embed_gives_sentence_transformers_embeddings_and_score_their_cosines(sentence_transformers, tmp_path):
    folder = write_encoder(tmp_path / "m", "bert", "mean")
    llm = LLM(model=str(folder), runner="pooling", dtype="float32")
    try:
        assert llm.task == "embed" and llm.engine is None
        outs = llm.embed(TEXTS)
        ours = torch.tensor([o.outputs.embedding for o in outs])
        theirs = sentence_transformers.SentenceTransformer(str(folder), device="cpu").encode(
            TEXTS, convert_to_tensor=True).float()
        assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.9999
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-4)  # the model normalizes
        assert outs[0].prompt_token_ids == llm.get_tokenizer()(TEXTS[0])["input_ids"] and outs[0].finished
        # token ids and {"prompt": ...} as prompts give the same vectors
        again = llm.embed([{"prompt_token_ids": outs[0].prompt_token_ids}, {"prompt": TEXTS[1]}])
        assert again[0].outputs.embedding == pytest.approx(outs[0].outputs.embedding, abs=1e-6)
        assert again[1].outputs.embedding == pytest.approx(outs[1].outputs.embedding, abs=1e-6)
        scores = llm.score(TEXTS[0], TEXTS[1:3])
        expected = [float(torch.dot(ours[0], ours[i])) for i in (1, 2)]
        assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-5)
        raw = llm.encode(TEXTS[0])[0].outputs.data  # the pooled state, before normalization
        assert torch.nn.functional.normalize(raw, dim=-1).tolist() == pytest.approx(outs[0].outputs.embedding,
                                                                                     abs=1e-6)
        with pytest.raises(InvalidRequestError, match="'embed' task, which does not generate text"):
            llm.generate("Hello", SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match="data_1 has 2 texts and data_2 3"):
            llm.score(TEXTS[:2], TEXTS[:3])
    finally:
        llm.shutdown()


def test_a_cross_encoder_s_score_is_its_own_as_sentence_transformers_gives_it(sentence_transformers, tmp_path):
    folder = write_encoder(tmp_path / "m", "cross")
    pairs = [(TEXTS[3], TEXTS[2]), (TEXTS[3], TEXTS[0])]
    theirs = sentence_transformers.CrossEncoder(str(folder), device="cpu").predict(pairs)
    llm = LLM(model=str(folder), dtype="float32")  # task auto: score, read from the checkpoint
    try:
        assert llm.task == "score"
        ours = [o.outputs.score for o in llm.score(TEXTS[3], [TEXTS[2], TEXTS[0]])]
        assert ours == pytest.approx([float(s) for s in theirs], abs=1e-5)
    finally:
        llm.shutdown()


def test_a_generative_model_refuses_pooling_calls_saying_what_to_load(tmp_path):
    from tiny_models import write_tiny_llama

    llm = LLM(model=str(write_tiny_llama(tmp_path)), dtype="float32", kv_cache_memory_bytes=4 << 20)
    try:
        with pytest.raises(InvalidRequestError, match=r'embed\(\) needs a pooling model: .* pass task="embed"'):
            llm.embed("Hello")
    finally:
        llm.shutdown()
