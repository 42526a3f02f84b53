"""The HF transformers baselines of ``pagoda bench``, run as their users run them: in a fresh process.

This file is executed as a script by the benchmark (``python hf_baseline.py``),
never imported as part of pagoda: the benchmark's process is tuned by pagoda
(the OpenMP wait policy the ``pagoda`` command chose, glibc's malloc thresholds
its engine set), and a baseline inside that process would be measured with
pagoda's settings instead of its own. The job comes as
JSON on stdin, the result goes as JSON to stdout (with ``pagoda_imported``,
which stays false):

    {"kind": "static", "model": DIR, "dtype": "float32", "threads": 2, "batch_size": 16,
     "requests": [[prompt ids, output length], ...]}          -> {"seconds": s}
    {"kind": "latency", ..., "requests": [[ids, n]], "repeats": 3} -> {"ttft": s, "tpot": s}
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

PAD = 0


def load(model_dir: str, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    model.generation_config.eos_token_id = None  # every request runs to its output length
    return model


def static_batches(model, requests: list, batch_size: int) -> float:
    """Left-padded batches as a conventional server runs them, each to its longest output. Returns seconds."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), PAD, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (prompt, _) in enumerate(batch):
                ids[i, width - len(prompt):] = torch.tensor(prompt)
                mask[i, width - len(prompt):] = 1
            n_out = max(n for _, n in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out,
                           do_sample=False, pad_token_id=PAD)
    return time.perf_counter() - start


def latency(model, prompt: list[int], n_out: int) -> tuple[float, float]:
    """Batch 1: time to the first token, then mean time per further token."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=PAD)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=PAD)
        total = time.perf_counter() - start
    return ttft, (total - ttft) / max(1, n_out - 1)


def run(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    model = load(job["model"], job["dtype"])
    if job["kind"] == "static":
        static_batches(model, [(job["requests"][0][0], 8)], 1)  # warm-up, as pagoda gets one
        return {"seconds": static_batches(model, job["requests"], job["batch_size"])}
    prompt, n_out = job["requests"][0]
    latency(model, prompt, 2)  # warm-up, as pagoda gets one: a first generate pays one-off costs
    runs = [latency(model, prompt, n_out) for _ in range(job["repeats"])]
    return {"ttft": statistics.median(r[0] for r in runs), "tpot": statistics.median(r[1] for r in runs)}


if __name__ == "__main__":
    # run as a script, this file's folder leads sys.path, and its neighbours (profile.py) would shadow the stdlib
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    result = run(json.load(sys.stdin))
    result["pagoda_imported"] = any(name.split(".")[0] == "pagoda" for name in sys.modules)  # must stay False
    json.dump(result, sys.stdout)
