"""The engine's tokenizer load: where it skips AutoTokenizer for the tokenizers-library class, the
tokenizer it returns is the one AutoTokenizer returns, token for token."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pagoda.engine.components import PLAIN_TOKENIZER_MODEL_TYPES, load_tokenizer, plain_tokenizer_dir
from pagoda.modeling.default_model import ensure_default_model

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café — 東京 🚀",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>tail", "", "x" * 300]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}]


def test_each_plain_model_type_is_one_autotokenizer_keeps_as_the_tokenizers_backend():
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    for model_type in sorted(PLAIN_TOKENIZER_MODEL_TYPES):
        registered = TOKENIZER_MAPPING_NAMES.get(model_type)
        # AutoTokenizer swaps the hub's class for the registered one only for these model types, and the
        # Mistral backend only where it is registered
        assert registered != "MistralCommonBackend", model_type
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS or registered in (
            None, "TokenizersBackend"), (model_type, registered)


def test_the_default_model_s_tokenizer_matches_autotokenizer_token_for_token():
    from transformers import AutoTokenizer

    path = str(ensure_default_model())
    assert plain_tokenizer_dir(path)
    ours, auto = load_tokenizer(path, None), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert ours.all_special_tokens == auto.all_special_tokens and ours.all_special_ids == auto.all_special_ids
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template",
                 "model_max_length", "padding_side", "add_bos_token", "add_eos_token"):
        assert getattr(ours, attr, None) == getattr(auto, attr, None), attr
    for text in TEXTS:
        ids = auto.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False), text
        assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip), text
    for gen in (False, True):
        for tokenize in (False, True):
            a = auto.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=tokenize)
            assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=tokenize) == a
    assert ours.batch_decode([auto.encode(t) for t in TEXTS]) == auto.batch_decode([auto.encode(t) for t in TEXTS])
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert load_tokenizer(path, template).apply_chat_template(MESSAGES, tokenize=False).startswith("[system] ")


def test_other_checkpoints_still_go_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    default_dir = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_dir / name, tmp_path / name)
    # transformers gives qwen2 its own tokenizer class whatever tokenizer_config.json says
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not plain_tokenizer_dir(str(tmp_path))
    assert type(load_tokenizer(str(tmp_path), None)) is type(AutoTokenizer.from_pretrained(str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x", None]}}))
    assert not plain_tokenizer_dir(str(tmp_path))  # custom code: AutoTokenizer decides
    (tmp_path / "tokenizer.json").unlink()
    assert not plain_tokenizer_dir(str(tmp_path))


def test_a_bad_tokenizer_directory_is_a_clear_error(tmp_path):
    from pagoda.errors import ConfigError

    shutil.copy(ensure_default_model() / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="cannot load a tokenizer from"):
        load_tokenizer(str(tmp_path), None)


def test_loading_the_default_tokenizer_leaves_the_model_config_imports_out():
    # what made AutoTokenizer slow: building the transformers model config imports torch.distributed.tensor
    # and accelerate (seconds of CPU in every server, replica and rank process)
    code = ("import sys\nfrom pagoda.engine.components import load_tokenizer\n"
            "from pagoda.modeling.default_model import ensure_default_model\n"
            "load_tokenizer(str(ensure_default_model()), None)\n"
            "print(sorted(m for m in ('transformers.core_model_loading', 'torch.distributed.tensor', 'accelerate')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_checkpoint_s_tokenizer_is_loaded_once_per_process_and_again_when_its_files_change(tmp_path):
    from pagoda.engine.engine_args import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from tiny_models import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path)
    args = EngineArgs.build(model=str(model_dir), load_format="dummy", kv_cache_memory_bytes=2 << 20, cpu_threads=1)
    first, second = LLMEngine.from_engine_args(args), LLMEngine.from_engine_args(args)
    assert first.tokenizer is second.tokenizer  # the engines of a process share one
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    templated = load_tokenizer(str(model_dir), template)
    assert templated is not first.tokenizer and templated is load_tokenizer(str(model_dir), template)
    assert templated.apply_chat_template(MESSAGES[:1], tokenize=False) == "<You are terse.>"
    assert first.tokenizer.chat_template == (model_dir / "chat_template.jinja").read_text()  # the shared one keeps its own
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    reloaded = load_tokenizer(str(model_dir), None)
    assert reloaded is not first.tokenizer and reloaded.eos_token == "<|im_start|>"
    assert first.tokenizer.eos_token == "<|im_end|>"
