"""Write a tiny random Llama checkpoint (with a 512-word tokenizer) for quantization tests.

    python contrib/quant-tools/make_tiny_llama.py OUT_DIR

Runs in pagoda's venv or any of the quantization tools' venvs (needs torch,
transformers, tokenizers). Weights are drawn with a fixed seed and a large
init range so the model's greedy choices are far from ties.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>"]


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "pad_token": "</s>", "model_max_length": 256,
    }, indent=1))


def main(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
