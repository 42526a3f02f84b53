"""Time every architecture pagoda serves at the default model's scale, so a user can see what each costs
against the Llama layout of SmolLM2-135M:

    python contrib/model-speed/arch_speed.py /tmp/arch-speed            # every architecture
    python contrib/model-speed/arch_speed.py /tmp/arch-speed --only Qwen3ForCausalLM GptOssForCausalLM

For each architecture it writes a random-weight checkpoint with transformers (bf16, the default model's
tokenizer) of SmolLM2-135M's shape: hidden 576, 30 layers, 9 query and 3 KV heads of 64, an MLP of 1,536 per
token (Mixture-of-Experts models: 8 experts of 768, 2 active, so a token's MLP costs what the dense one does),
then runs ``pagoda bench latency`` (W3: 128 prompt tokens, 128 output tokens, batch 1) and ``pagoda bench
throughput --num-requests 16`` (the first 16 W1 requests) on it in a fresh process, and prints one Markdown row
per architecture with its time per token and its output tok/s, and each as a ratio to Llama's in the same run.
The weights are random: the speed is the architecture's, not a trained model's answers.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from pagoda.modeling.default_model import ensure_default_model

SHAPE = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=True, pad_token_id=None)
DENSE = dict(intermediate_size=1536)
MOE_EXPERTS, MOE_ACTIVE, MOE_INTER = 8, 2, 768


def config(arch: str):
    """The transformers config of ``arch`` at the default model's scale."""
    t = transformers
    dense = {**SHAPE, **DENSE}
    if arch == "LlamaForCausalLM":
        return t.LlamaConfig(**dense)
    if arch == "MistralForCausalLM":
        return t.MistralConfig(**dense, sliding_window=4096)
    if arch == "Qwen2ForCausalLM":
        return t.Qwen2Config(**dense)
    if arch == "Qwen3ForCausalLM":
        return t.Qwen3Config(**dense)
    if arch == "SmolLM3ForCausalLM":
        return t.SmolLM3Config(**dense)
    if arch == "Gemma2ForCausalLM":
        return t.Gemma2Config(**dense, query_pre_attn_scalar=64, sliding_window=512)
    if arch == "Gemma3ForCausalLM":
        return t.Gemma3TextConfig(**dense, query_pre_attn_scalar=64, sliding_window=512)
    if arch == "Olmo2ForCausalLM":
        return t.Olmo2Config(**{k: v for k, v in dense.items() if k != "head_dim"})
    if arch == "GraniteForCausalLM":
        return t.GraniteConfig(**{k: v for k, v in dense.items() if k != "head_dim"})
    if arch == "Phi3ForCausalLM":
        return t.Phi3Config(**{k: v for k, v in dense.items() if k != "head_dim"})
    moe = {**SHAPE, "intermediate_size": MOE_INTER}
    if arch == "MixtralForCausalLM":
        return t.MixtralConfig(**moe, num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_ACTIVE)
    if arch == "Qwen2MoeForCausalLM":
        return t.Qwen2MoeConfig(**moe, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_ACTIVE,
                                moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=MOE_INTER)
    if arch == "Qwen3MoeForCausalLM":
        return t.Qwen3MoeConfig(**moe, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_ACTIVE,
                                moe_intermediate_size=MOE_INTER)
    if arch == "GptOssForCausalLM":
        return t.GptOssConfig(**moe, num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_ACTIVE,
                              sliding_window=128)
    raise SystemExit(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "SmolLM3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM",
                 "GraniteForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                 "Qwen3MoeForCausalLM", "GptOssForCausalLM")


def write(arch: str, out: Path) -> Path:
    """A random-weight bf16 checkpoint of ``arch`` in ``out/arch`` (kept if already written)."""
    directory = out / arch
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(arch), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, directory / name)
    return directory


def bench(args: list[str], pattern: str) -> float:
    """Run ``pagoda bench ARGS`` in a fresh process and read one figure from its output."""
    done = subprocess.run([str(Path(sys.executable).parent / "pagoda"), "bench", *args], capture_output=True, text=True)
    found = re.search(pattern, done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"pagoda bench {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="where the checkpoints are written (about 0.3 GB each)")
    parser.add_argument("--only", nargs="+", default=None, help="these architectures (Llama is always run)")
    parser.add_argument("--cpu-threads", type=int, default=2)
    args = parser.parse_args()
    chosen = ["LlamaForCausalLM"] + [a for a in (args.only or ARCHITECTURES) if a != "LlamaForCausalLM"]
    common = ["--no-baseline", "--cpu-threads", str(args.cpu_threads), "--dtype", "bfloat16"]
    print("| architecture | batch 1: ms per output token | vs Llama | 16 W1 requests: output tok/s | vs Llama |")
    print("|---|---|---|---|---|")
    base = None
    # Llama again at the end: how far the machine's speed drifted during the run
    for arch in chosen + ["LlamaForCausalLM"] * (len(chosen) > 1):
        try:
            model = str(write(arch, args.out_dir))
            tpot = bench(["latency", "--model", model, "--repeats", "1", *common],
                         r"pagoda: TTFT.*?TPOT\s+([0-9.]+)")
            tps = bench(["throughput", "--model", model, "--num-requests", "16", *common],
                        r"pagoda:.*?([0-9.]+)\s+output tok/s")
        except (SystemExit, Exception) as exc:  # one architecture's failure is its row, not the end of the table
            print(f"| `{arch}` | failed: {str(exc).strip().splitlines()[-1][:200]} | | | |", flush=True)
            continue
        base = base or (tpot, tps)
        print(f"| `{arch}` | {tpot:.1f} | {tpot / base[0]:.2f}x | {tps:.1f} | {tps / base[1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
