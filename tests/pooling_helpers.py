"""Tiny random pooling checkpoints written with transformers, with their sentence-transformers files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the cat sat on a mat dog ran fast slow red blue green paris is capital of france berlin germany "
         "what where who how many apples pears rain sun cloud river sea boat car road city town").split()
TEXTS = ["the cat sat on a mat", "dog ran fast", "paris is the capital of france",
         "what is the capital of germany", "red blue green sea boat car road city town rain sun cloud river"]


def write_st_files(folder: Path, pooling: str, normalize: bool = True, max_seq_length: int = 64) -> None:
    """modules.json, 1_Pooling/config.json and sentence_bert_config.json of a sentence-transformers model."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": pooling == "last"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": False}))


def _bert_tokenizer(folder: Path) -> None:
    from transformers import BertTokenizer

    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizer(vocab=str(vocab), do_lower_case=True, model_max_length=64).save_pretrained(str(folder))


def _byte_tokenizer(folder: Path) -> None:
    """A Qwen2 tokenizer (byte-level BPE) without merges: one token per byte."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                   pad_token="<|endoftext|>", model_max_length=64).save_pretrained(str(folder))


def _small(config_class, **extra):
    return config_class(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=66, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **extra)


def write_encoder(folder: Path, kind: str = "bert", pooling: str = "mean", seed: int = 0) -> Path:
    """A tiny random BertModel / XLMRobertaModel (``kind``) embedding checkpoint, or a one-label
    BertForSequenceClassification cross-encoder (``kind="cross"``)."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, XLMRobertaConfig, \
        XLMRobertaModel

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "bert":
        model = BertModel(_small(BertConfig, type_vocab_size=2), add_pooling_layer=False)
    elif kind == "roberta":
        model = XLMRobertaModel(_small(XLMRobertaConfig, pad_token_id=0, type_vocab_size=1),
                                add_pooling_layer=False)
    else:
        model = BertForSequenceClassification(_small(BertConfig, type_vocab_size=2, num_labels=1))
        with torch.no_grad():  # scores spread over (0, 1) rather than all near 0.5
            model.classifier.weight.normal_(0, 2.0)
            model.bert.pooler.dense.weight.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    _bert_tokenizer(folder)
    if kind != "cross":
        write_st_files(folder, pooling)
    return folder


def write_decoder(folder: Path, arch: str = "qwen2", pooling: str = "last", seed: int = 0,
                  matryoshka: bool = True) -> Path:
    """A tiny random Qwen2 / Llama decoder used for embeddings (a byte-level tokenizer for Qwen2, word-piece for
    Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig,
                                                                                         LlamaForCausalLM)
    cfg = config_class(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)
    model_class(cfg).save_pretrained(str(folder))
    if arch == "qwen2":  # transformers loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, whatever is saved
        _byte_tokenizer(folder)
    else:
        _bert_tokenizer(folder)
    if matryoshka:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    write_st_files(folder, pooling)
    return folder
