"""Check pagoda against a quantization tool's reference on the tool's own checkpoint.

    PAGODA_CPU_THREADS=1 .venv/bin/python contrib/quant-tools/compare_with_reference.py CKPT [CKPT ...]

Each CKPT was written by one of the quantize_*.py scripts beside this file and
holds reference/generations.json (greedy tokens of the tool's runtime, and the
top-2 logits of every step when the reference was dumped with them). Prints,
per checkpoint, whether pagoda's greedy tokens equal them and the weight
memory against bf16. Where a prompt parts from the reference, it prints the
step and both runtimes' margin between the two candidate tokens there, so a
near-tie shows as one. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def first_divergence(got: list[int], expected: list[int]) -> int:
    return next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)


def describe_divergence(step: int, got: list[int], expected: list[int], logprobs, ref_top2) -> str:
    """Both runtimes' logit margin between pagoda's token and the reference's at the first differing step."""
    ours, theirs = got[step], expected[step]
    where = f"parts at generated token {step}: pagoda {ours}, reference {theirs}"
    lps = logprobs[step]
    if theirs in lps:
        where += f"; pagoda's margin {lps[ours].logprob - lps[theirs].logprob:.4f}"
    else:
        where += "; the reference's token is not in pagoda's top 2"
    if ref_top2 is not None:
        ids, logits = ref_top2[step]
        if ids[1] == ours:
            where += f", the reference's margin {logits[0] - logits[1]:.4f}"
        elif ids[0] == ours:  # the reference's raw logits put pagoda's token first, yet it did not pick it
            where += ", the reference's raw top token is pagoda's (a token it bans, e.g. EOS before min tokens)"
        else:
            where += f", pagoda's token is not the reference's second (its top-2 margin {logits[0] - logits[1]:.4f})"
    return where


# pagoda's fused linears and the checkpoint modules stacked along their output rows
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}


def layer_difference(model, dequant_path: Path) -> tuple[int, float]:
    """Every quantized linear applied to the identity (rows of ``I``: ``W^T`` exactly, in float32) against
    the tool's own dequantization (reference/dequant.safetensors). Returns (linears, max abs difference)."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(str(dequant_path))
    count, worst = 0, 0.0
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for fused, parts in FUSED.items():
                linear = getattr(layer, fused)
                w = torch.cat([ref[f"model.layers.{i}.{p}.weight"] for p in parts]).float()  # [out, in]
                got = linear(torch.eye(linear.in_features)).t()
                worst = max(worst, float((got - w).abs().max()))
                count += len(parts)
    return count, worst


def main(paths: list[str]) -> int:
    from pagoda import LLM, SamplingParams
    from pagoda.plugins.quant.memory import weight_memory

    failures = 0
    for path in map(Path, paths):
        expected = json.loads((path / "reference" / "generations.json").read_text())
        num_tokens = len(expected["outputs"][0])
        llm = LLM(str(path), dtype="float32")
        # min_tokens bans EOS for every step, as transformers' min_new_tokens does in the reference (with
        # ignore_eos, EOS would stay a candidate instead)
        params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, temperature=0, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in expected["prompts"]], params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        same = sum(g == e for g, e in zip(got, expected["outputs"]))
        failures += same != len(got)
        tokenizer = llm.get_tokenizer()
        print(f"{path.name}: {same}/{len(got)} prompts give the reference runtime's {num_tokens} greedy tokens")
        if (path / "reference" / "dequant.safetensors").exists():
            count, worst = layer_difference(llm.engine.runner.model, path / "reference" / "dequant.safetensors")
            print(f"  {count} linears against the tool's own dequantization: max abs difference {worst:.3g}")
        top2 = expected.get("top2") or [None] * len(got)
        for prompt, g, e, out, ref_top2 in zip(expected["prompts"], got, expected["outputs"], outs, top2):
            print(f"  {tokenizer.decode(prompt)!r} -> {tokenizer.decode(g)!r}")
            if g != e:
                print(f"    reference: {tokenizer.decode(e)!r}")
                print("    " + describe_divergence(first_divergence(g, e), g, e, out.outputs[0].logprobs, ref_top2))
        del llm
        print("  memory (bf16 model):", weight_memory(LLM(str(path), dtype="bfloat16").engine.runner.model).describe())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
