"""Write a random-weight Mixture-of-Experts checkpoint of a realistic shape (Qwen3-MoE architecture), to time
pagoda against transformers on an MoE without downloading one:

    python contrib/moe-bench/make_random_moe.py OUT_DIR --layers 8
    pagoda bench latency --model OUT_DIR --dtype bfloat16 --max-model-len 512
    pagoda bench throughput --model OUT_DIR --dtype bfloat16 --max-model-len 1024

Default shape: hidden 1024, 64 experts of intermediate size 512, 8 active per token, 16 query / 4 KV heads of
128, the default model's tokenizer (vocabulary 49,152). Expert weights are 201 MB per layer in bf16, of which a
token reads 25 MB (8 of 64 experts); 24 layers would take 4.8 GB, so ``--layers`` scales the depth down for a
machine that cannot hold that (a decode step's time grows linearly with the layers).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from pagoda.modeling.default_model import ensure_default_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--active", type=int, default=8)
    parser.add_argument("--expert-intermediate", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    tokenizer_dir = ensure_default_model()
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                         intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_intermediate,
                         num_experts=args.experts, num_experts_per_tok=args.active, norm_topk_prob=True,
                         max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    model.save_pretrained(str(args.out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, args.out_dir / name)
    expert_bytes = 3 * args.hidden * args.expert_intermediate * model.dtype.itemsize
    print(f"wrote {args.out_dir}: {args.layers} layers, {args.experts} experts x {args.active} active, "
          f"{expert_bytes * args.active * args.layers / 1e6:.1f} MB of expert weights read per token")


if __name__ == "__main__":
    main()
