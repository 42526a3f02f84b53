"""One engine's run for compare_moe.py, in a process of its own: pagoda (run by pagoda's python) or vLLM (run by
the python of vLLM's venv, which has no pagoda: nothing here imports pagoda unless the job asks for it).

The job comes as JSON on stdin; the result goes as JSON to the file the job names (vLLM prints to stdout):

    {"engine": "pagoda" | "vllm", "model": DIR, "dtype": "bfloat16" | "float32" | null (the engine's default),
     "max_model_len": 1024, "requests": [[prompt ids, output length], ...], "batch1_prompt": [ids],
     "batch1_tokens": 16, "repeats": 3, "result": PATH}
    -> {"load_seconds": s, "threads": n or null, "requests_seconds": s, "prompt_tokens": n, "output_tokens": n,
        "batch1_seconds_per_token": [s, ...]}

Both engines get the same token ids and the same sampling (greedy, ``ignore_eos``, ``min_tokens`` =
``max_tokens``), and the prefix cache is emptied before every timed generation so no prompt is a cache hit.
"""

from __future__ import annotations

import json
import os
import sys
import time


def load_engine(job: dict):
    """The engine's ``LLM``, its ``SamplingParams`` class, a function emptying its prefix cache, and its threads."""
    kwargs = {"max_model_len": job["max_model_len"]}
    if job["dtype"] is not None:
        kwargs["dtype"] = job["dtype"]
    if job["engine"] == "pagoda":
        from pagoda.host.settings import set_openmp_wait_policy

        set_openmp_wait_policy()  # as the pagoda command does at its start, before torch loads
        from pagoda import LLM, SamplingParams

        llm = LLM(job["model"], **kwargs)
        return llm, SamplingParams, llm.engine.kv_manager.reset_prefix_cache, llm.engine.num_threads
    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], seed=0, **kwargs)
    return llm, SamplingParams, llm.reset_prefix_cache, None


def timed_generate(llm, params_class, reset_cache, requests: list) -> tuple[float, int]:
    """Every request at once, from a cold prefix cache: seconds and output tokens."""
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [params_class(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for _, n in requests]
    reset_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(out.outputs[0].token_ids) for out in outputs)


def run(job: dict) -> dict:
    start = time.perf_counter()
    llm, params_class, reset_cache, threads = load_engine(job)
    result = {"load_seconds": time.perf_counter() - start, "threads": threads}
    requests = job["requests"]
    timed_generate(llm, params_class, reset_cache, requests[:4])  # warm-up, as pagoda bench throughput does
    seconds, num_output = timed_generate(llm, params_class, reset_cache, requests)
    result.update(requests_seconds=seconds, prompt_tokens=sum(len(ids) for ids, _ in requests),
                  output_tokens=num_output)
    prompt, n = job["batch1_prompt"], job["batch1_tokens"]
    timed_generate(llm, params_class, reset_cache, [(prompt, n + 1)])  # warm-up
    per_token = []
    for _ in range(job["repeats"]):
        one, _ = timed_generate(llm, params_class, reset_cache, [(prompt, 1)])
        more, _ = timed_generate(llm, params_class, reset_cache, [(prompt, n + 1)])
        per_token.append((more - one) / n)  # the prefill cancels out: n decode steps remain
    result["batch1_seconds_per_token"] = per_token
    return result


if __name__ == "__main__":
    # run as a script, this file's folder leads sys.path; nothing here should be found there
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    job = json.load(sys.stdin)
    with open(job["result"], "w") as f:
        json.dump(run(job), f)
