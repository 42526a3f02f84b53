"""EleutherAI's lm-evaluation-harness scores a multiple-choice task through ``pagoda serve``.

Its ``local-completions`` model sends the choices as token ids with ``echo``, ``logprobs: 1`` and
``max_tokens: 1`` to a real ``pagoda serve`` on 127.0.0.1 (the default model, float32); its own ``hf`` model
scores the same items with HF transformers on the same checkpoint. Each item's loglikelihoods must agree, and
so the accuracies. The task and its items are written here: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import free_port

# looked up, not imported: importing lm-eval (and datasets) takes seconds, paid only when the test runs
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                                   reason="lm-eval is not installed (pip install -e '.[test]')")]

PAGODA = str(Path(sys.executable).with_name("pagoda"))
MODEL = "SmolLM2-135M-Instruct"
TASK = "pagoda_tiny_mc"
ITEMS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid", " Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" three", " four", " five"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit", " Kelvin"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " purple", " loud"], "answer": 0},
    {"question": "A week has seven", "choices": [" days", " hours", " years"], "answer": 0},
    {"question": "The sun rises in the", "choices": [" west", " east", " north", " south"], "answer": 1},
]


def write_task(directory: Path) -> Path:
    """A multiple-choice task of ITEMS as lm-eval's YAML, reading a local JSON-lines file."""
    data = directory / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    return directory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``pagoda serve`` on the default model, in float32, on a free port of 127.0.0.1."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([PAGODA, "serve", "--port", str(port), "--dtype", "float32",
                                 "--kv-cache-memory-bytes", str(64 << 20), "--uvicorn-log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PAGODA_CPU_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a loaded machine may first build the CPU kernels
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pagoda serve did not become healthy:\n{log.read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def evaluate(model: str, model_args: dict, task_dir: Path) -> tuple[float, list[list[float]]]:
    """lm-eval's accuracy on the task and each item's loglikelihood per choice, in item order. Only the task
    written here is indexed: lm-eval's own hundreds of task files took 17 s of CPU to index, at every call."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=4, log_samples=True,
                              task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                              bootstrap_iters=0)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(resp[0]) for resp in sample["filtered_resps"]] for sample in samples]
    return results["results"][TASK]["acc,none"], loglikelihoods


def test_lm_eval_loglikelihoods_through_pagoda_serve_equal_its_hf_model_on_the_same_checkpoint(
        served, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    checkpoint = str(ensure_default_model())
    task_dir = write_task(tmp_path)
    served_acc, served_ll = evaluate(
        "local-completions", {"model": MODEL, "base_url": served + "/v1/completions", "tokenizer": checkpoint,
                              "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1}, task_dir)
    hf_acc, hf_ll = evaluate("hf", {"pretrained": checkpoint, "dtype": "float32", "device": "cpu"}, task_dir)
    assert [len(item["choices"]) for item in ITEMS] == [len(lls) for lls in served_ll]
    for item, got, want in zip(ITEMS, served_ll, hf_ll):
        assert got == pytest.approx(want, abs=2e-3), item["question"]
    assert served_acc == hf_acc
    assert served_acc >= 0.5  # the model knows most of these: the scores are the model's, not noise
