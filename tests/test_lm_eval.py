"""EleutherAI's lm-evaluation-harness scores a multiple-choice task through pagoda's OpenAI server.

Its ``local-completions`` model sends the choices as token ids with ``echo``, ``logprobs: 1`` and
``max_tokens: 1`` to a real uvicorn server on 127.0.0.1 (the default model, float32); its own ``hf`` model
scores the same items with HF transformers on the same checkpoint. Each item's loglikelihoods must agree, and
so the accuracies. The task and its items are written here: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from one_engine import release

from pagoda import LLM
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.modeling.default_model import ensure_default_model
from pagoda.plugins.entrypoints.server import ServerThread, build_app

# looked up, not imported: importing lm-eval (and datasets) takes seconds, paid only when the test runs
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                                   reason="lm-eval is not installed (pip install -e '.[test]')")]

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
def served():
    """A real uvicorn server on 127.0.0.1 over the default model in float32, as ``pagoda serve --dtype float32``
    serves it, in this process (lm-eval's client and the server's answers are what is checked, not the command;
    ``test_server_cli.py`` runs ``pagoda serve`` itself)."""
    llm = LLM(dtype="float32", cpu_threads=1, kv_cache_memory_bytes=64 << 20)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine))).start()
    yield srv.url
    srv.stop()
    release(llm)  # nothing the module built stays in the worker
    del llm, srv


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
