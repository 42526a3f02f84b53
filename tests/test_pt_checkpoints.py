"""Checkpoints published before safetensors: PyTorch weight files (``pytorch_model*.bin``, sharded with an index,
or ``*.pt``) load with ``--load-format pt`` or ``auto``, give the tokens of the same weights in safetensors, and a
file that holds code or is cut short is refused naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import CheckpointError
from pagoda.modeling.default_model import ensure_default_model

PROMPTS = [{"prompt_token_ids": [5, 17, 301, 42, 9]}, {"prompt_token_ids": [1200, 77, 3]}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny random Llama written by transformers twice: as safetensors, and as PyTorch files in shards."""
    import transformers

    root = tmp_path_factory.mktemp("pt-checkpoints")
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_default_model())
    model.save_pretrained(root / "safetensors")
    tokenizer.save_pretrained(root / "safetensors")
    # the same weights as transformers wrote PyTorch checkpoints before safetensors: torch.save shards and an index
    # (transformers now writes safetensors only)
    from safetensors.torch import load_file

    shutil.copytree(root / "safetensors", root / "bin")
    state = {}
    for path in sorted((root / "bin").glob("*.safetensors")):
        state.update(load_file(str(path)))
        path.unlink()
    (root / "bin" / "model.safetensors.index.json").unlink(missing_ok=True)
    names = sorted(state)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save({n: state[n] for n in shard}, root / "bin" / file)
        weight_map.update({n: file for n in shard})
    (root / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
         "weight_map": weight_map}))
    return root


def greedy(model_dir, **kwargs) -> tuple[str, list[list[int]]]:
    llm = LLM(model=str(model_dir), dtype="float32", cpu_threads=1, kv_cache_memory_bytes=8 << 20, **kwargs)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        return llm.engine.config.model.load_format, [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


def test_sharded_pytorch_files_load_by_auto_and_give_the_safetensors_tokens(checkpoints):
    assert (checkpoints / "bin" / "pytorch_model.bin.index.json").is_file()
    assert len(list((checkpoints / "bin").glob("pytorch_model-*.bin"))) >= 2  # sharded
    assert not list((checkpoints / "bin").glob("*.safetensors"))
    fmt, tokens = greedy(checkpoints / "bin")
    assert fmt == "pt"
    assert ("safetensors", tokens) == greedy(checkpoints / "safetensors")


def test_a_single_pt_file_loads_with_load_format_pt(checkpoints, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(checkpoints / "bin", one)
    state = {}
    for shard in sorted(one.glob("pytorch_model-*.bin")):
        state.update(torch.load(shard, weights_only=True))
        shard.unlink()
    (one / "pytorch_model.bin.index.json").unlink()
    torch.save(state, one / "weights.pt")
    assert greedy(one, load_format="pt") == ("pt", greedy(checkpoints / "safetensors")[1])


class Payload:
    """An object whose unpickling would run code: a tensors-only load refuses it."""

    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_a_file_holding_code_or_cut_short_is_refused_naming_it(checkpoints, tmp_path, capfd):
    for name, write in (("code", lambda path: torch.save({"model.embed_tokens.weight": Payload()}, path)),
                        ("cut", lambda path: path.write_bytes(
                            (checkpoints / "bin" / sorted(p.name for p in (checkpoints / "bin").glob(
                                "pytorch_model-*.bin"))[0]).read_bytes()[:1000]))):
        bad = tmp_path / name
        shutil.copytree(checkpoints / "bin", bad)
        shard = sorted(bad.glob("pytorch_model-*.bin"))[0]
        write(shard)
        with pytest.raises(CheckpointError) as refused:
            greedy(bad)
        assert str(refused.value).startswith(f"{shard} is not a readable PyTorch weight file (")
        assert "re-download or re-convert the checkpoint" in str(refused.value)
    assert "this ran while loading" not in capfd.readouterr().out


def test_each_format_on_a_directory_without_its_files_says_which_to_pass(checkpoints):
    with pytest.raises(CheckpointError, match="has no PyTorch weight files .* pass --load-format safetensors"):
        greedy(checkpoints / "safetensors", load_format="pt")
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors files; pass --load-format pt"):
        greedy(checkpoints / "bin", load_format="safetensors")


def test_the_pooling_models_read_the_same_tensors_from_either_format(checkpoints):
    """BERT-family embedding and reranking models read their checkpoint through iter_checkpoint, which picks
    the files as auto does."""
    from pagoda.modeling.loader import iter_checkpoint

    from_bin = dict(iter_checkpoint(checkpoints / "bin"))
    from_safetensors = dict(iter_checkpoint(checkpoints / "safetensors"))
    assert from_bin.keys() == from_safetensors.keys()
    assert all(torch.equal(from_bin[name], from_safetensors[name]) for name in from_bin)
