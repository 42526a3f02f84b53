"""Check pagoda against a quantization tool's reference on the tool's own checkpoint.

    PAGODA_CPU_THREADS=1 .venv/bin/python contrib/quant-tools/compare_with_reference.py CKPT [CKPT ...]

Each CKPT was written by one of the quantize_*.py scripts beside this file and
holds reference/generations.json (greedy tokens of the tool's runtime). Prints,
per checkpoint, whether pagoda's greedy tokens equal them and the weight
memory against bf16. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    from pagoda import LLM, SamplingParams
    from pagoda.plugins.quant.memory import weight_memory

    failures = 0
    for path in map(Path, paths):
        expected = json.loads((path / "reference" / "generations.json").read_text())
        num_tokens = len(expected["outputs"][0])
        llm = LLM(str(path), dtype="float32")
        params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in expected["prompts"]], params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        same = sum(g == e for g, e in zip(got, expected["outputs"]))
        failures += same != len(got)
        tokenizer = llm.get_tokenizer()
        print(f"{path.name}: {same}/{len(got)} prompts give the reference runtime's {num_tokens} greedy tokens")
        for prompt, g, e in zip(expected["prompts"], got, expected["outputs"]):
            print(f"  {tokenizer.decode(prompt)!r} -> {tokenizer.decode(g)!r}" + ("" if g == e else
                  f"   (reference: {tokenizer.decode(e)!r})"))
        del llm
        print("  memory (bf16 model):", weight_memory(LLM(str(path), dtype="bfloat16").engine.runner.model).describe())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
