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
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig

from pagoda.modeling.default_model import ensure_default_model


def write_random_moe(out_dir: Path, layers: int = 24, hidden: int = 1024, experts: int = 64, active: int = 8,
                     expert_intermediate: int = 512, dtype: str = "bfloat16") -> int:
    """Write the checkpoint to ``out_dir``: every matrix drawn from N(0, 0.02) (the config's initializer range, as
    transformers initializes them), every norm's weights 1. Returns the bytes of expert weights a token reads."""
    tokenizer_dir = ensure_default_model()
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                         intermediate_size=4 * hidden, moe_intermediate_size=expert_intermediate,
                         num_experts=experts, num_experts_per_tok=active, norm_topk_prob=True,
                         max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False,
                         dtype=dtype)
    gen = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=getattr(torch, dtype)).mul_(cfg.initializer_range)

    def ones(n: int) -> torch.Tensor:  # an RMSNorm's weights
        return torch.ones(n, dtype=getattr(torch, dtype))

    # Qwen3-MoE's tensor names, as transformers saves them (one tensor per expert and projection)
    q_width, kv_width, head_dim = 16 * 128, 4 * 128, 128
    tensors = {"model.embed_tokens.weight": draw(cfg.vocab_size, hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}"
        tensors.update({f"{layer}.input_layernorm.weight": ones(hidden),
                        f"{layer}.post_attention_layernorm.weight": ones(hidden),
                        f"{layer}.self_attn.q_proj.weight": draw(q_width, hidden),
                        f"{layer}.self_attn.k_proj.weight": draw(kv_width, hidden),
                        f"{layer}.self_attn.v_proj.weight": draw(kv_width, hidden),
                        f"{layer}.self_attn.o_proj.weight": draw(hidden, q_width),
                        f"{layer}.self_attn.q_norm.weight": ones(head_dim),
                        f"{layer}.self_attn.k_norm.weight": ones(head_dim),
                        f"{layer}.mlp.gate.weight": draw(experts, hidden)})
        for e in range(experts):
            tensors.update({f"{layer}.mlp.experts.{e}.gate_proj.weight": draw(expert_intermediate, hidden),
                            f"{layer}.mlp.experts.{e}.up_proj.weight": draw(expert_intermediate, hidden),
                            f"{layer}.mlp.experts.{e}.down_proj.weight": draw(hidden, expert_intermediate)})
    tensors.update({"model.norm.weight": ones(hidden), "lm_head.weight": draw(cfg.vocab_size, hidden)})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return 3 * hidden * expert_intermediate * getattr(torch, dtype).itemsize * active * layers


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
    expert_bytes = write_random_moe(args.out_dir, args.layers, args.hidden, args.experts, args.active,
                                    args.expert_intermediate, args.dtype)
    print(f"wrote {args.out_dir}: {args.layers} layers, {args.experts} experts x {args.active} active, "
          f"{expert_bytes / 1e6:.1f} MB of expert weights read per token")


if __name__ == "__main__":
    main()
