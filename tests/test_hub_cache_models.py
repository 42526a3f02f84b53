"""``--model owner/name`` as vLLM users pass it: the snapshot already in the local Hugging Face cache is served
(pagoda never downloads), and a name that is not there is refused saying how to fetch it."""

from __future__ import annotations

import pytest
from tiny_models import write_tiny_llama

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache (the layout huggingface_hub writes) holding ``tiny-org/tiny-llama`` at ``main``."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    write_tiny_llama(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may reach the network, whatever happens
    return snapshot


def test_a_hub_id_in_the_local_cache_is_served_under_its_name(hub_cache):
    llm = LLM(model="tiny-org/tiny-llama", dtype="float32", cpu_threads=1, kv_cache_memory_bytes=8 << 20)
    try:
        config = llm.engine.config.model
        assert config.model == str(hub_cache) and config.served_model_name == "tiny-org/tiny-llama"
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()


def test_a_hub_id_not_in_the_cache_says_how_to_fetch_it(hub_cache):
    with pytest.raises(ConfigError) as refused:
        LLM(model="tiny-org/absent-model")
    message = str(refused.value)
    assert "nor a model in the local Hugging Face cache" in message
    assert "`hf download tiny-org/absent-model`" in message and "never downloads" in message
    with pytest.raises(ConfigError, match="is not a local directory; pagoda loads"):
        LLM(model="./no/such/folder")


def test_a_tokenizer_hub_id_in_the_cache_is_read_from_it(hub_cache):
    llm = LLM(model=str(hub_cache), tokenizer="tiny-org/tiny-llama", dtype="float32", cpu_threads=1,
              kv_cache_memory_bytes=8 << 20)
    try:
        assert llm.engine.config.model.tokenizer == str(hub_cache)
    finally:
        llm.engine.shutdown()
    with pytest.raises(ConfigError, match="^--tokenizer: model 'tiny-org/absent' is not a local directory nor"):
        LLM(model=str(hub_cache), tokenizer="tiny-org/absent")
