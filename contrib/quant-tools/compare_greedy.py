"""Greedy tokens and log-probabilities of a quantized pagoda model against float32, on the parity prompts.

    .venv/bin/python contrib/quant-tools/compare_greedy.py --quantization int8 [--model CKPT] [--tokens 32]
    .venv/bin/python contrib/quant-tools/compare_greedy.py --model W8A8_CKPT [--reference-model DENSE_CKPT]

The prompts are the HF-parity prompts of tests/test_models.py. The reference is ``--reference-model``
(default: pagoda's default model) in float32, the tested run ``--model`` with ``--quantization``, also
with float32 activations. Printed per prompt: how many of the first ``--tokens`` greedy tokens are identical and
where they first part; then, teacher-forced on the float32 greedy continuation, how often the quantized
model's argmax is the same token and the largest / mean difference of the chosen tokens' log-probs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def engine(model, quantization):
    from pagoda import LLM

    return LLM(model, dtype="float32", quantization=quantization, kv_cache_memory_bytes=256 << 20, swap_space=0,
               max_model_len=2048)


def greedy(llm, prompts, num_tokens):
    from pagoda import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, temperature=0, ignore_eos=True)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def scored(llm, sequences, num_tokens):
    """Per sequence: (log-prob of each of the last ``num_tokens`` tokens, whether it was the argmax)."""
    from pagoda import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    result = []
    for out, seq in zip(outs, sequences):
        positions = range(len(seq) - num_tokens, len(seq))
        logprobs = torch.tensor([out.prompt_logprobs[i][seq[i]].logprob for i in positions])
        is_top = [out.prompt_logprobs[i][seq[i]].rank == 1 for i in positions]
        result.append((logprobs, is_top))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint to test (default: pagoda's default model)")
    parser.add_argument("--quantization", default=None, help="e.g. int8 for online W8A8")
    parser.add_argument("--reference-model", default=None, help="float32 reference checkpoint (default: the default "
                        "model)")
    parser.add_argument("--tokens", type=int, default=32)
    ns = parser.parse_args()
    from test_models import PROMPTS

    ref = engine(ns.reference_model, None)
    ref_seqs = greedy(ref, PROMPTS, ns.tokens)
    ref_scores = scored(ref, ref_seqs, ns.tokens)
    del ref
    quant = engine(ns.model, ns.quantization)
    quant_seqs = greedy(quant, PROMPTS, ns.tokens)
    quant_scores = scored(quant, ref_seqs, ns.tokens)
    same_prompts = same_tokens = agree = 0
    drifts = []
    for i, (a, b) in enumerate(zip(ref_seqs, quant_seqs)):
        gen_a, gen_b = a[-ns.tokens:], b[-ns.tokens:]
        first = next((j for j, (x, y) in enumerate(zip(gen_a, gen_b)) if x != y), None)
        same = sum(x == y for x, y in zip(gen_a, gen_b))
        drift = (ref_scores[i][0] - quant_scores[i][0]).abs()
        top = sum(quant_scores[i][1])
        drifts.append(drift)
        same_prompts += first is None
        same_tokens += same
        agree += top
        print(f"prompt {i}: {same}/{ns.tokens} greedy tokens identical"
              f"{'' if first is None else f' (first parts at token {first})'}; teacher-forced argmax "
              f"{top}/{ns.tokens}; |d logprob| max {float(drift.max()):.3f} mean {float(drift.mean()):.3f}")
    drift = torch.cat(drifts)
    n = len(PROMPTS)
    print(f"all: {same_prompts}/{n} prompts identical for {ns.tokens} tokens, {same_tokens}/{n * ns.tokens} tokens "
          f"identical, teacher-forced argmax {agree}/{n * ns.tokens}, |d logprob| max {float(drift.max()):.3f} "
          f"mean {float(drift.mean()):.4f}")


if __name__ == "__main__":
    main()
